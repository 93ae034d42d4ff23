//! Crash campaigns: marud killed with SIGKILL at random moments under load, and clients
//! killed in the middle of stores. After each: every acknowledged entry is back with its
//! bytes, no partial entry is visible, and the space is what the surviving entries explain.
//! `MARU_CRASH_KILLS` sets the number of kills of each kind (20 by default; more by hand).

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use maru_tests::{Daemon, Opts, bin, pattern};
use rand::Rng;

fn kills() -> usize {
    std::env::var("MARU_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

fn seed_of(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn size_of(key: &str) -> usize {
    1000 + (seed_of(key) % 30_000) as usize
}

fn client(d: &Daemon, pool: Option<&str>) -> maru::Handler {
    maru::Handler::connect(maru::Config {
        socket: d.socket.clone(),
        pool: pool.map(str::to_owned),
        ..Default::default()
    })
    .unwrap()
}

/// Every entry in `ns` has exactly the bytes its key implies; returns how many there are.
fn verify_namespace(h: &maru::Handler, ns: &str) -> usize {
    let (_, _, entries) = h.list(ns).unwrap();
    for e in &entries {
        let path = format!("{ns}/{}", e.key);
        let m = h
            .retrieve(&path)
            .unwrap()
            .unwrap_or_else(|| panic!("{path} listed but missing"));
        assert!(
            m.as_slice() == pattern(seed_of(&path), size_of(&path)),
            "{path}: wrong or partial bytes ({} bytes)",
            m.len()
        );
    }
    entries.len()
}

#[test]
fn daemon_killed_at_random_moments() {
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts {
        pools: vec![
            "memfs:{dir}/pool,size=96M,name=mem".into(),
            "file:{dir}/dev.img,size=96M,name=emu".into(),
        ],
        mount: true,
        extra: vec!["--eviction".into(), "off".into()],
    });
    d.handler().mkdir("c", 0o755).unwrap();
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut rng = rand::thread_rng();
    for round in 0..kills() {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        // Writer 3 says where it publishes: its entries are packed.
        for (w, pool, ns) in [
            (0, Some("mem"), None),
            (1, Some("emu"), None),
            (2, None, None),
            (3, Some("mem"), Some("c")),
        ] {
            let (acked, stop) = (acked.clone(), stop.clone());
            let sock = d.socket.clone();
            let mnt = d.mount.clone().unwrap();
            threads.push(std::thread::spawn(move || {
                let Ok(h) = maru::Handler::connect(maru::Config {
                    socket: sock,
                    pool: pool.map(str::to_owned),
                    namespace: ns.map(str::to_owned),
                    ..Default::default()
                }) else {
                    return;
                };
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let key = format!("c/r{round}-w{w}-{i}");
                    let data = pattern(seed_of(&key), size_of(&key));
                    let ok = if w != 2 {
                        h.put(&key, &data).is_ok()
                    } else {
                        // Through the mount, as doc/SEMANTICS.md says a careful writer does: on a
                        // write error, unlink the name before closing so nothing is published.
                        // Acknowledged once another door sees the entry.
                        let path = mnt.join(&key);
                        let mut f = match std::fs::File::create_new(&path) {
                            Ok(f) => f,
                            Err(_) => return,
                        };
                        if std::io::Write::write_all(&mut f, &data).is_err() {
                            let _ = std::fs::remove_file(&path);
                            return;
                        }
                        drop(f);
                        h.exists(&key).unwrap_or(false)
                    };
                    if !ok {
                        return;
                    }
                    acked.lock().unwrap().push(key);
                }
            }));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(20..150)));
        d.kill9();
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        d.restart();
        let h = d.handler();
        let want = acked.lock().unwrap().clone();
        for key in &want {
            let m = h
                .retrieve(key)
                .unwrap()
                .unwrap_or_else(|| panic!("round {round}: acknowledged {key} lost"));
            assert!(
                m.as_slice() == pattern(seed_of(key), size_of(key)),
                "round {round}: {key} changed"
            );
        }
        let n = verify_namespace(&h, "c");
        assert!(n >= want.len());
        let st = h.stats().unwrap();
        for p in &st.pools {
            assert_eq!(
                p.writing_bytes, 0,
                "round {round}: allocations survived the crash"
            );
        }
    }
    // No leaked space: delete everything, the raw pool is empty again and the tmpfs nearly so.
    let h = client(&d, None);
    let (_, _, entries) = h.list("c").unwrap();
    let keys: Vec<String> = entries.iter().map(|e| format!("c/{}", e.key)).collect();
    for chunk in keys.chunks(500) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        assert!(h.batch_delete(&refs).unwrap().iter().all(Result::is_ok));
    }
    h.trim();
    let st = h.stats().unwrap();
    for p in &st.pools {
        assert_eq!(p.entries, 0);
        assert_eq!(p.sealed_bytes, 0);
        let slack = if p.kind.is_raw() { 0 } else { 1 << 20 };
        assert!(
            p.used <= slack,
            "pool {} leaks {} bytes after {} kills",
            p.name,
            p.used,
            kills()
        );
    }
    eprintln!(
        "daemon kills: {}, acknowledged entries checked: {}",
        kills(),
        keys.len()
    );
}

#[test]
fn clients_killed_in_the_middle_of_stores() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec![
            "memfs:{dir}/pool,size=64M,name=mem".into(),
            "file:{dir}/dev.img,size=64M,name=emu".into(),
        ],
        mount: false,
        extra: vec![],
    });
    let h = d.handler();
    h.mkdir("k", 0o755).unwrap();
    let mut rng = rand::thread_rng();
    let mut total = 0;
    for round in 0..kills() {
        let mut child = std::process::Command::new(bin("maru-probe"))
            .args([
                "storeloop",
                d.socket.to_str().unwrap(),
                "k",
                &format!("c{round}"),
                "16384",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        std::thread::sleep(Duration::from_millis(rng.gen_range(10..80)));
        child.kill().unwrap();
        child.wait().unwrap();
        let acked: Vec<u64> = BufReader::new(out)
            .lines()
            .map(|l| l.unwrap().parse().unwrap())
            .collect();
        for i in &acked {
            let key = format!("k/c{round}-{i}");
            let m = h
                .retrieve(&key)
                .unwrap()
                .unwrap_or_else(|| panic!("acknowledged {key} lost"));
            assert!(m.as_slice() == pattern(*i, 16384), "{key} changed");
        }
        total += acked.len();
        // Whatever the killed client had allocated is reclaimed.
        let t = std::time::Instant::now();
        loop {
            let st = h.stats().unwrap();
            let mine: u64 = st.clients.iter().map(|c| c.allocated).sum();
            let writing: u64 = st.pools.iter().map(|p| p.writing_bytes).sum();
            if writing == mine {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "round {round}: not reclaimed: {st:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Nothing partial is visible: every entry has the bytes of its index.
    let (_, _, entries) = h.list("k").unwrap();
    for e in &entries {
        let i: u64 = e.key.rsplit('-').next().unwrap().parse().unwrap();
        let m = h.retrieve(&format!("k/{}", e.key)).unwrap().unwrap();
        assert!(m.as_slice() == pattern(i, 16384), "{} partial", e.key);
    }
    eprintln!(
        "client kills: {}, acknowledged entries checked: {total}",
        kills()
    );
}

/// A writer through the mount killed with SIGKILL in the middle of a store publishes nothing;
/// one that exits normally without closing publishes what it wrote.
#[test]
fn mount_writers_killed_mid_store_publish_nothing() {
    maru_tests::require_root!();
    const PY: &str = r#"
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
for i in range(1000):
    os.write(fd, bytes([i % 251]) * 4096)
    if i == 3:
        print("writing", flush=True)
    time.sleep(0.001)
os._exit(0)
"#;
    let d = Daemon::start(Opts::default());
    std::fs::create_dir(d.path("m")).unwrap();
    let h = d.handler();
    let free = || {
        nix::sys::statvfs::statvfs(d.pool_dir())
            .map(|s| s.blocks_free())
            .unwrap()
    };
    let before = free();
    let mut rng = rand::thread_rng();
    for round in 0..kills() {
        let p = d.path(&format!("m/k{round}"));
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(PY)
            .arg(&p)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..200)));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !h.exists(&format!("m/k{round}")).unwrap(),
            "round {round}: a killed writer's entry was published"
        );
        assert!(std::fs::metadata(&p).is_err());
    }
    // Nothing of them is left in the pool: no file, and all their space back.
    let t = std::time::Instant::now();
    while std::fs::read_dir(d.pool_dir().join("w")).unwrap().count() > 0 || free() != before {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "abandoned files left in the pool ({} blocks free, {before} before)",
            free()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A writer that exits normally without closing publishes what it wrote.
    let p = d.path("m/done");
    let ok = std::process::Command::new("python3")
        .arg("-c")
        .arg(PY)
        .arg(&p)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success());
    assert!(h.exists("m/done").unwrap());
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1000 * 4096);
}

/// The threads of process `pid` whose name starts with `prefix`.
fn threads_named(pid: u32, prefix: &str) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
        })
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

/// A thread's scheduling state (`R`, `S`, `D`, …) from `/proc/PID/task/TID/stat`.
fn thread_state(pid: u32, tid: i32) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default();
    s.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("")
        .to_owned()
}

/// Seed 822 of the faults harness, made certain: marud is killed while its invalidation of a
/// name waits in the kernel for the name's directory, locked by a client's create that waits
/// for marud's answer. That thread cannot die, so marud never finishes exiting and its mount's
/// requests are never aborted; its successor must end it (by the connection's fusectl abort)
/// and start. The FUSE workers are held with ptrace, which stops single threads.
#[test]
fn a_marud_stuck_in_its_exit_is_ended_by_its_successor() {
    use nix::sys::{ptrace, wait};
    use nix::unistd::Pid;
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts {
        extra: ["--fuse-uring", "off", "--fuse-threads", "1"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    });
    let h = d.handler();
    h.mkdir("ns", 0o777).unwrap();
    h.put("ns/a", &pattern(1, 4096)).unwrap();
    h.put("ns/kept", &pattern(2, 4096)).unwrap();
    // The kernel caches the name: removing it behind its back makes marud invalidate it.
    assert_eq!(std::fs::metadata(d.path("ns/a")).unwrap().len(), 4096);
    let pid = d.pid();
    let workers = threads_named(pid, "fuser-");
    assert!(!workers.is_empty(), "no FUSE worker thread found");
    for &t in &workers {
        ptrace::seize(Pid::from_raw(t), ptrace::Options::empty()).unwrap();
        ptrace::interrupt(Pid::from_raw(t)).unwrap();
        wait::waitpid(Pid::from_raw(t), Some(wait::WaitPidFlag::__WALL)).unwrap();
    }
    // A client's create in ns: the kernel holds the directory's lock until marud answers.
    let p = d.path("ns/b");
    let client = std::thread::spawn(move || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(p)
            .map(drop)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !client.is_finished(),
        "the create was answered by a stopped marud"
    );
    // A delete through the socket: marud's invalidation of ns/a now waits for that lock.
    h.delete("ns/a").unwrap();
    let inval = threads_named(pid, "maru-inval");
    assert_eq!(inval.len(), 1);
    let t = std::time::Instant::now();
    while thread_state(pid, inval[0]) != "D" {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the invalidation never waited for the directory (state {})",
            thread_state(pid, inval[0])
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    d.kill9();
    // The held workers die with the rest; as their tracer, the test reaps them.
    for &t in &workers {
        let _ = wait::waitpid(Pid::from_raw(t), Some(wait::WaitPidFlag::__WALL));
    }
    assert!(
        d.dying().is_some(),
        "marud exited though a thread of it waited for the directory"
    );
    // maructl doctor says what happened and what to do.
    let cfg = d.dir.join("marud.toml");
    let mount = d.mount.clone().expect("mounted");
    let text = format!(
        "state_dir = \"{}\"\nsocket = \"{}\"\nmount = \"{}\"\n",
        d.dir.join("state").display(),
        d.socket.display(),
        mount.display()
    );
    std::fs::write(&cfg, text).unwrap();
    let out = std::process::Command::new(bin("maructl"))
        .args(["doctor", "--config"])
        .arg(&cfg)
        .env_remove("MARU_SOCKET")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("stuck in its exit") && report.contains("/abort"),
        "doctor did not see the stuck marud:\n{report}"
    );
    // The successor aborts the stuck connection: the client's create fails, the killed marud
    // exits (`restart` checks it within 10 s), and the new one serves the same store.
    d.restart();
    let r = client.join().unwrap();
    assert!(r.is_err(), "the create succeeded on an aborted connection");
    assert!(d.log_text().contains("aborting it"), "no abort was logged");
    let h = d.handler();
    assert!(!h.exists("ns/a").unwrap());
    assert_eq!(
        h.retrieve("ns/kept").unwrap().unwrap().as_slice(),
        pattern(2, 4096)
    );
    assert_eq!(
        std::fs::read(d.path("ns/kept")).unwrap(),
        pattern(2, 4096),
        "the new mount does not serve the store"
    );
    std::fs::write(d.path("ns/b"), b"after").unwrap();
    assert!(h.exists("ns/b").unwrap());
}

/// A change of a memfs entry's owner is three steps on its file (mode 0, the owner, the
/// mode): a crash between them left the entry at mode 0 for good. The owner and mode it is
/// given are written on the file first (`user.maru.owning`), and a restart finishes the
/// change; one that is not cut leaves no mark.
#[test]
fn a_change_of_owner_cut_by_a_crash_is_finished_at_restart() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts::default());
    let h = d.handler();
    h.mkdir("own", 0o755).unwrap();
    let bytes = pattern(7, 200 << 10); // a file of its own, not a piece of a pack
    for k in ["own/done", "own/cut"] {
        h.put(k, &bytes).unwrap();
    }
    let dir = d.pool_dir().join("n/own");
    let file = |k: &str| dir.join(k);
    let owner = |p: &std::path::Path| {
        let md = std::fs::metadata(p).unwrap();
        (md.uid(), md.gid(), md.mode() & 0o7777)
    };
    std::os::unix::fs::chown(d.path("own/done"), Some(65534), Some(65534)).unwrap();
    assert_eq!(owner(&file("done")).0, 65534);
    assert!(
        maru_tests::xattr(&file("done"), "user.maru.owning").is_err(),
        "a change done leaves no mark"
    );
    d.kill9();
    // marud died after the first step of giving own/cut to 65534:65534 with mode 0640.
    maru_tests::set_xattr(&file("cut"), "user.maru.owning", b"65534:65534:640").unwrap();
    std::fs::set_permissions(file("cut"), std::fs::Permissions::from_mode(0o000)).unwrap();
    d.restart();
    assert_eq!(owner(&file("cut")), (65534, 65534, 0o640));
    assert_eq!(owner(&d.path("own/cut")), (65534, 65534, 0o640));
    assert!(maru_tests::xattr(&file("cut"), "user.maru.owning").is_err());
    let h = d.handler();
    for k in ["own/done", "own/cut"] {
        let m = h.retrieve(k).unwrap().unwrap_or_else(|| panic!("{k} lost"));
        assert_eq!(m.as_slice(), &bytes[..], "{k}");
    }
}
