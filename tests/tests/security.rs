//! Security: marud keeps only the capabilities it needs, its files are private, and a
//! non-root user cannot read, write, delete or pin another user's entries through the socket
//! (the mount is covered by mount::other_users_cannot_touch_a_private_namespace).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;

use maru_tests::{Daemon, Opts, ReadCounts, Reaped, bin, pattern, xattr};

fn caps_of(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

#[test]
fn marud_keeps_only_the_capabilities_it_needs() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    // CAP_CHOWN (0), CAP_DAC_OVERRIDE (1), CAP_FOWNER (3), CAP_SYS_ADMIN (21).
    let want = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 21);
    for f in ["CapEff:", "CapPrm:", "CapBnd:"] {
        assert_eq!(caps_of(d.pid(), f), want, "{f} of marud");
    }
    assert_eq!(caps_of(d.pid(), "CapInh:"), 0);
    // It still does its job with them: store and read through both doors.
    std::fs::create_dir(d.path("c")).unwrap();
    std::fs::write(d.path("c/k"), b"works").unwrap();
    assert_eq!(
        d.handler().retrieve("c/k").unwrap().unwrap().as_slice(),
        b"works"
    );
}

#[test]
fn daemon_files_are_private() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    d.handler().mkdir("p", 0o755).unwrap();
    d.handler().put("p/k", b"x").unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(d.pool_dir()), 0o700, "pool directory");
    assert_eq!(mode(&d.dir.join("state")), 0o700, "state directory");
    assert_eq!(mode(&d.socket), 0o660, "socket");
    let backing = d.pool_dir().join("n/p/k");
    assert_eq!(std::fs::metadata(&backing).unwrap().uid(), 0);
}

/// maru-probe run as user and group `id`, with no other groups.
fn probe_as(id: u32) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={id}"),
        format!("--regid={id}"),
        "--clear-groups".into(),
    ])
    .arg(bin("maru-probe"));
    c
}

fn as_nobody(d: &Daemon, op: &str, path: &str) -> String {
    let out = probe_as(65534)
        .args(["try", d.socket.to_str().unwrap(), op, path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// What `nobody` gets through maru-probe: a `batch_retrieve` of `keys` (a line each), its
/// read counts, then one line per path of `then`, retrieved one by one.
fn batch_as_nobody(d: &Daemon, keys: &[String], then: &[&str]) -> String {
    let flag = d.dir.join("go");
    std::fs::write(&flag, b"").unwrap();
    let mut args: Vec<String> = vec![
        "openwait".into(),
        d.socket.display().to_string(),
        flag.display().to_string(),
        keys.len().to_string(),
    ];
    args.extend(keys.iter().cloned());
    args.push("--".into());
    args.extend(then.iter().map(|p| p.to_string()));
    let out = probe_as(65534).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs [`batch_as_nobody`] and checks that nobody read every key of `keys`, all in one
/// `retrieve` from marud (`bytes` of them) and opening nothing itself, the counts being
/// `before` until then; returns the outcomes of `then`.
fn nobody_reads_the_batch_through_marud(
    d: &Daemon,
    keys: &[String],
    then: &[&str],
    before: &ReadCounts,
    bytes: u64,
) -> Vec<String> {
    let text = batch_as_nobody(d, keys, then);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[..keys.len()], vec!["ok"; keys.len()][..], "{text}");
    assert_eq!(
        lines[keys.len()],
        ReadCounts {
            retrieve: before.retrieve + 1,
            accessed: before.accessed,
            bytes: before.bytes + bytes,
        }
        .to_string(),
        "nobody asked marud for the batch and opened nothing itself"
    );
    lines[keys.len() + 1..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

/// A daemon on a memfs pool whose socket `nobody` may connect to: the socket belongs to a
/// group the test user is in (nogroup, 65534), as `maru` would be; with the mount if `mount`.
fn daemon_nobody_reaches(mount: bool) -> Daemon {
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount,
        extra: vec!["--group".into(), "nogroup".into()],
    });
    std::fs::set_permissions(&d.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

#[test]
fn another_user_cannot_touch_a_private_namespace_through_the_socket() {
    maru_tests::require_root!();
    let d = daemon_nobody_reaches(false);
    assert_eq!(std::fs::metadata(&d.socket).unwrap().gid(), 65534);
    let h = d.handler();
    h.mkdir("private", 0o700).unwrap();
    h.put("private/secret", &pattern(1, 5000)).unwrap();
    h.mkdir("shared", 0o777).unwrap();
    // Quotas are root's: not even the owner of an open namespace may set one.
    assert_eq!(as_nobody(&d, "quota", "shared"), "permission_denied");
    for op in ["retrieve", "exists", "put", "delete", "pin"] {
        let path = if op == "put" {
            "private/new"
        } else {
            "private/secret"
        };
        assert_eq!(
            as_nobody(&d, op, path),
            "permission_denied",
            "nobody could {op} {path}"
        );
    }
    assert_eq!(as_nobody(&d, "mkdir", "private/sub"), "permission_denied");
    assert_eq!(
        h.retrieve("private/secret").unwrap().unwrap().as_slice(),
        &pattern(1, 5000)[..]
    );
    assert!(!h.exists("private/new").unwrap());
    assert!(!h.is_pinned("private/secret").unwrap());
    // Where the mode allows it, the same user works normally.
    assert_eq!(as_nobody(&d, "put", "shared/mine"), "ok");
    assert_eq!(as_nobody(&d, "retrieve", "shared/mine"), "ok");
    // A user outside the socket's group cannot even connect.
    let out = probe_as(65533)
        .args(["try", d.socket.to_str().unwrap(), "exists", "shared/mine"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "io", "{out:?}");
}

#[test]
fn thousands_of_idle_connections_do_not_stop_service() {
    maru_tests::require_root!();
    // Let this test process hold them.
    // SAFETY: getrlimit/setrlimit with a valid out-parameter.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: false,
        extra: vec![],
    });
    let mut idle = Vec::new();
    for i in 0..3000 {
        match std::os::unix::net::UnixStream::connect(&d.socket) {
            Ok(s) => idle.push(s),
            Err(e) => panic!("connection {i} refused: {e}"),
        }
    }
    let h = d.handler();
    h.mkdir("busy", 0o755).unwrap();
    h.put("busy/k", b"still serving").unwrap();
    assert_eq!(
        h.retrieve("busy/k").unwrap().unwrap().as_slice(),
        b"still serving"
    );
    drop(idle);
    assert_eq!(h.stats().unwrap().pools[0].entries, 1);
}

/// A root client opens a memfs entry's file itself, through the namespace's directory that
/// marud gave it with the shared index: a first-time retrieve takes no round trip, and marud
/// learns of it afterwards (`accessed`, counted as retrieved). Anyone else gets no directory
/// and asks marud for each entry, which applies the policy.
/// With `acl=off` a memfs pool's namespace directories are root's 0700 with no ACL, as on a
/// tmpfs without ACLs: root opens entries' files itself, anyone else asks marud for each first
/// retrieve, and files are given their entry's mode one by one (marud's umask is 0077). A pool
/// an earlier run gave ACLs loses them at the restart.
#[test]
fn with_acl_off_only_root_clients_open_memfs_entries_themselves() {
    maru_tests::require_root!();
    let mut d = daemon_nobody_reaches(true);
    let writer = d.handler();
    writer.mkdir("open", 0o755).unwrap();
    writer.put("open/k0", b"before").unwrap();
    // A namespace nobody owns: its directory's ACL names nobody.
    writer.mkdir("mine", 0o755).unwrap();
    std::os::unix::fs::chown(d.path("mine"), Some(65534), None).unwrap();
    let tree = d.pool_dir().join("n");
    let mode = |ns: &str| {
        let md = std::fs::metadata(tree.join(ns)).unwrap();
        (md.uid(), md.gid(), md.mode() & 0o7777)
    };
    assert_eq!(
        mode("open"),
        (0, 0, 0o755),
        "acl=on: open to all for reading"
    );
    assert!(
        xattr(&d.pool_dir().join("n/mine"), "system.posix_acl_access").is_ok(),
        "acl=on: the ACL of nobody's namespace"
    );
    drop(writer);
    d.kill9();
    d.restart_with(|args| {
        let spec = args.iter_mut().find(|a| a.starts_with("memfs:")).unwrap();
        spec.push_str(",acl=off");
    });
    let writer = d.handler();
    writer.mkdir("late", 0o755).unwrap();
    let keys: Vec<String> = (1..11).map(|i| format!("open/k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        writer.put(k, &pattern(i as u64, 3000 + i)).unwrap();
    }
    writer.put("late/k", b"late").unwrap();
    let no_acl = |p: &std::path::Path, name: &str| {
        let e = xattr(p, name).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENODATA),
            "{name} of {}",
            p.display()
        );
    };
    for ns in ["open", "mine", "late"] {
        assert_eq!(mode(ns), (0, 0, 0o700), "{ns}");
        no_acl(&d.pool_dir().join("n").join(ns), "system.posix_acl_access");
    }
    no_acl(&d.pool_dir().join("n"), "system.posix_acl_access");
    no_acl(&d.pool_dir().join("w"), "system.posix_acl_default");
    for f in ["open/k0", "open/k1", "late/k"] {
        let md = std::fs::metadata(d.pool_dir().join("n").join(f)).unwrap();
        assert_eq!(md.mode() & 0o7777, 0o644, "{f}: the entry's mode");
    }
    // Root opens the files itself: one report, no retrieve.
    let c0 = ReadCounts::of(&writer).unwrap();
    let reader = d.handler();
    let paths: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(reader.batch_retrieve(&paths).unwrap().len(), keys.len());
    let c1 = ReadCounts::of(&reader).unwrap();
    assert_eq!((c1.retrieve, c1.accessed), (c0.retrieve, c0.accessed + 1));
    // nobody may read them too, but only through marud: one retrieve of the batch.
    let sizes: u64 = (0..10).map(|i| 3000 + i as u64).sum();
    nobody_reads_the_batch_through_marud(&d, &keys, &[], &c1, sizes);
}

#[test]
fn clients_open_memfs_entries_themselves_as_the_policy_allows() {
    maru_tests::require_root!();
    let d = daemon_nobody_reaches(true);
    let writer = d.handler();
    writer.mkdir("open", 0o755).unwrap();
    let keys: Vec<String> = (0..100).map(|i| format!("open/k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        writer.put(k, &pattern(i as u64, 3000 + i)).unwrap();
    }
    let c0 = ReadCounts::of(&writer).unwrap();
    let reader = d.handler();
    let paths: Vec<&str> = keys.iter().map(String::as_str).collect();
    let got = reader.batch_retrieve(&paths).unwrap();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(
            m.as_ref().unwrap().as_slice(),
            &pattern(i as u64, 3000 + i)[..]
        );
    }
    // The reader's next request carries the report of what it opened.
    let c1 = ReadCounts::of(&reader).unwrap();
    assert_eq!(
        c1.retrieve, c0.retrieve,
        "a root client asked marud for entries it could open"
    );
    assert_eq!(c1.accessed, c0.accessed + 1, "one report of the batch");
    let total: u64 = (0..100).map(|i| 3000 + i as u64).sum();
    assert_eq!(
        c1.bytes - c0.bytes,
        total,
        "the entries opened count as retrieved"
    );
    // A key stored again is a new file: the reader maps the new one, not its cached mapping.
    writer.delete("open/k0").unwrap();
    writer.put("open/k0", b"again").unwrap();
    assert_eq!(
        reader.retrieve("open/k0").unwrap().unwrap().as_slice(),
        b"again"
    );

    // Another user opens what the policy lets it read, through the same directories: the
    // kernel decides from each one's ACL (its namespace's access, never write) and each
    // file's owner and mode (its entry's).
    let mnt = d.mount.clone().unwrap();
    let dir = d.pool_dir().join("n/open");
    let md = std::fs::metadata(&dir).unwrap();
    assert_eq!(
        (md.uid(), md.mode() & 0o022),
        (0, 0),
        "root's, no write but root's"
    );
    writer.put("open/private", b"mine").unwrap();
    std::fs::set_permissions(
        mnt.join("open/private"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    writer.put("open/late", b"later").unwrap();
    // A namespace nobody owns, open to its owner alone: the ACL names the owner.
    writer.mkdir("mine", 0o755).unwrap();
    writer.put("mine/x", b"owned").unwrap();
    std::os::unix::fs::chown(mnt.join("mine"), Some(65534), None).unwrap();
    std::fs::set_permissions(mnt.join("mine"), std::fs::Permissions::from_mode(0o500)).unwrap();
    let flag = d.dir.join("revoked");
    let c2 = ReadCounts::of(&writer).unwrap();
    let mut args: Vec<String> = vec![
        "openwait".into(),
        d.socket.display().to_string(),
        flag.display().to_string(),
        "99".into(),
    ];
    args.extend(keys[1..].iter().cloned());
    args.extend(
        [
            "open/private",
            "mine/x",
            "exists:open/k1",
            "--",
            "open/late",
            "exists:open/after",
        ]
        .map(String::from),
    );
    // Killed if the test fails before letting it finish (it waits for the flag).
    let mut probe = Reaped(
        probe_as(65534)
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(probe.0.stdout.take().unwrap()));
    let mut next = || lines.next().unwrap().unwrap();
    for k in &keys[1..] {
        assert_eq!(next(), "ok", "nobody's retrieve of {k}");
    }
    assert_eq!(next(), "permission_denied", "a 0600 entry of root's");
    assert_eq!(next(), "ok", "an entry in nobody's own namespace");
    assert_eq!(next(), "true", "exists, from the index nobody mapped");
    let sizes: u64 = (1..100).map(|i| 3000 + i as u64).sum::<u64>() + 5;
    assert_eq!(
        next(),
        ReadCounts {
            retrieve: c2.retrieve + 1,
            accessed: c2.accessed + 2,
            bytes: c2.bytes + sizes,
        }
        .to_string(),
        "nobody opened the 99 entries and its own namespace's itself (two reports); only the private one went to marud"
    );
    // The namespace closes: the kernel refuses the directory nobody holds at once, and the
    // index it mapped is retired, so a name stored since is not shown to it.
    std::fs::set_permissions(mnt.join("open"), std::fs::Permissions::from_mode(0o700)).unwrap();
    writer.put("open/after", b"new").unwrap();
    std::fs::write(&flag, b"").unwrap();
    assert_eq!(next(), "permission_denied", "after the namespace closed");
    assert_eq!(
        next(),
        "permission_denied",
        "a name stored after the namespace closed"
    );
    assert_eq!(
        next(),
        ReadCounts {
            retrieve: c2.retrieve + 2,
            accessed: c2.accessed + 2,
            bytes: c2.bytes + sizes,
        }
        .to_string(),
        "marud refused it: nothing read"
    );
    assert!(probe.0.wait().unwrap().success());
}

/// Packed entries are read as the policy allows: root maps their pack itself (no request to
/// marud, one report); another user allowed to read the namespace gets the pack from marud
/// once for the batch; one that may not read it gets nothing.
#[test]
fn packed_entries_are_read_as_the_policy_allows() {
    maru_tests::require_root!();
    let d = daemon_nobody_reaches(false);
    let writer = maru::Handler::connect(maru::Config {
        namespace: Some("open".into()),
        ..d.client_config()
    })
    .unwrap();
    writer.mkdir("open", 0o755).unwrap();
    writer.mkdir("closed", 0o700).unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("open/k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        writer.put(k, &pattern(i as u64, 3000 + i)).unwrap();
    }
    let closed = maru::Handler::connect(maru::Config {
        namespace: Some("closed".into()),
        ..d.client_config()
    })
    .unwrap();
    closed.put("closed/secret", &pattern(99, 3000)).unwrap();
    let loc = |k: &str| {
        let s = writer.stat(k).unwrap().unwrap();
        maru::index::packed(s.offset).unwrap_or_else(|| panic!("{k} is not packed"))
    };
    assert_eq!(loc("open/k0").0, loc("open/k19").0, "one pack");
    assert_ne!(
        loc("open/k0").0,
        loc("closed/secret").0,
        "a pack per namespace"
    );

    let c0 = ReadCounts::of(&writer).unwrap();
    let reader = d.handler();
    let paths: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (i, m) in reader.batch_retrieve(&paths).unwrap().iter().enumerate() {
        assert_eq!(
            m.as_ref().unwrap().as_slice(),
            &pattern(i as u64, 3000 + i)[..]
        );
    }
    let c1 = ReadCounts::of(&reader).unwrap();
    assert_eq!(
        (c1.retrieve, c1.accessed),
        (c0.retrieve, c0.accessed + 1),
        "root maps the pack itself"
    );
    let sizes: u64 = (0..20).map(|i| 3000 + i as u64).sum();
    assert_eq!(c1.bytes - c0.bytes, sizes);

    // nobody: one request for the batch, and no report.
    let then = nobody_reads_the_batch_through_marud(&d, &keys, &["closed/secret"], &c1, sizes);
    assert_eq!(then[0], "permission_denied", "{then:?}");
}
