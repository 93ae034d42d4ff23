//! The publication rule for writers through the mount:
//!
//! - an entry written through the mount is published only if every write its writer made
//!   succeeded, whatever the program does after an error (closes, exits without closing, is
//!   killed), for ENOSPC, EDQUOT, EFBIG and short writes, over both FUSE transports;
//! - a writer whose entry will not be published learns it from `close` (or earlier, from
//!   `write`), never by its absence: every writer whose `close` returned success finds its
//!   entry published, visible to other processes as soon as `close` returns. (So a writer
//!   whose write failed gets an error from `close` too.)
//!
//! The writers are plain programs, as users would run them: Python, `cp`, `dd`.

use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdout, Command, Output, Stdio};
use std::time::{Duration, Instant};

use maru_tests::{Daemon, Opts, Reaped, pattern};

/// Both ways the kernel's requests reach marud: io_uring (where the kernel has it) and
/// `/dev/fuse`.
const TRANSPORTS: [&str; 2] = ["auto", "off"];
const MIB: usize = 1 << 20;

fn daemon(pool: &str, eviction: &str, transport: &str) -> Daemon {
    Daemon::start(Opts {
        pools: vec![pool.into()],
        mount: true,
        extra: vec![
            "--eviction".into(),
            eviction.into(),
            "--fuse-uring".into(),
            transport.into(),
        ],
    })
}

/// Python helpers every script starts with: `pattern(seed, size)` is [`py_pattern`].
const PY_LIB: &str = r#"
import errno, mmap, os, sys, time
def pattern(seed, size):
    block = bytes((j * 7 + seed) % 256 for j in range(256))
    return (block * (size // 256 + 1))[:size]
"#;

/// The bytes `pattern(seed, size)` makes in Python.
fn py_pattern(seed: usize, size: usize) -> Vec<u8> {
    (0..size).map(|i| ((i % 256) * 7 + seed) as u8).collect()
}

fn python(script: &str) -> Command {
    let mut c = Command::new("python3");
    c.arg("-c").arg(format!("{PY_LIB}{script}"));
    c
}

/// Runs a Python script to the end; returns its output (whatever its exit status).
fn run_python(script: &str, args: &[&str]) -> Output {
    python(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running python3")
}

fn stdout_of(o: &Output) -> String {
    assert!(
        o.status.success(),
        "python failed ({}): {}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).expect("utf8")
}

/// A Python program running in the background, talking line by line.
struct Talker {
    child: Reaped,
    out: BufReader<ChildStdout>,
}

impl Talker {
    fn start(script: &str, args: &[&str]) -> Self {
        let mut child = python(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting python3");
        let out = BufReader::new(child.stdout.take().expect("piped"));
        Talker {
            child: Reaped(child),
            out,
        }
    }

    /// The program's next line (panics if it ended).
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).expect("reading python's output");
        if l.is_empty() {
            let st = self.child.0.wait().expect("wait");
            panic!("the python program ended ({st}) without a word");
        }
        l.trim().to_owned()
    }

    fn tell(&mut self, what: &str) {
        let stdin = self.child.0.stdin.as_mut().expect("piped");
        writeln!(stdin, "{what}").expect("writing to python");
        stdin.flush().expect("flush");
    }

    fn finish(mut self) -> std::process::ExitStatus {
        drop(self.child.0.stdin.take());
        self.child.0.wait().expect("wait")
    }
}

/// `ns/key` is not published, for another process: `stat` says ENOENT, `ls` does not list
/// it, libmaru says it does not exist.
fn assert_unpublished(d: &Daemon, ns: &str, key: &str, what: &str) {
    let p = d.path(&format!("{ns}/{key}"));
    let e = std::fs::metadata(&p).err();
    assert_eq!(
        e.as_ref().and_then(std::io::Error::raw_os_error),
        Some(libc::ENOENT),
        "{what}: stat {ns}/{key} should fail with ENOENT, got {e:?}"
    );
    let listed: Vec<String> = std::fs::read_dir(d.path(ns))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !listed.iter().any(|n| n == key),
        "{what}: ls {ns} lists {key}: {listed:?}"
    );
    assert!(
        !d.handler().exists(&format!("{ns}/{key}")).unwrap(),
        "{what}: libmaru finds {ns}/{key}"
    );
}

/// `ns/key` is published with exactly `data`, through the mount and through libmaru.
fn assert_published(d: &Daemon, ns: &str, key: &str, data: &[u8], what: &str) {
    let got = std::fs::read(d.path(&format!("{ns}/{key}")))
        .unwrap_or_else(|e| panic!("{what}: reading {ns}/{key} through the mount: {e}"));
    assert!(
        got == data,
        "{what}: {ns}/{key} through the mount has {} bytes, not the {} written",
        got.len(),
        data.len()
    );
    let m = d
        .handler()
        .retrieve(&format!("{ns}/{key}"))
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: libmaru does not find {ns}/{key}"));
    assert!(
        m.as_slice() == data,
        "{what}: {ns}/{key} through libmaru differs ({} bytes)",
        m.len()
    );
}

/// Bytes the first pool accounts as used (sealed, being written, held).
fn pool_used(d: &Daemon) -> u64 {
    d.handler().stats().unwrap().pools[0].used
}

/// Bytes used in the first pool's tmpfs.
fn tmpfs_used(d: &Daemon) -> u64 {
    let s = nix::sys::statvfs::statvfs(d.pool_dir()).unwrap();
    (s.blocks() - s.blocks_free()) * s.fragment_size()
}

/// Waits (a few seconds at most) until the pool is back to `before` (accounted and tmpfs
/// bytes, the latter within 1 MiB for the daemon's own files): nothing leaked.
fn assert_space_returns(d: &Daemon, before: (u64, u64), what: &str) {
    let t = Instant::now();
    loop {
        let now = (pool_used(d), tmpfs_used(d));
        if now.0 == before.0 && now.1 <= before.1 + MIB as u64 {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what}: the pool did not get its space back: used {} (was {}), tmpfs {} (was {})",
            now.0,
            before.0,
            now.1,
            before.1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes `size`-byte entries `k0, k1, ...` into a directory with `open(path, "xb")` and one
/// `write` each, until one fails; prints `stored I` per entry, then `failed I ERRNO` with the
/// first error (a failing `write` in a `with` block is followed by `close`'s error, which
/// Python raises with the first one as its context).
const PY_FILL: &str = r#"
ns, size = sys.argv[1], int(sys.argv[2])
for i in range(1000):
    try:
        with open(os.path.join(ns, f"k{i}"), "xb") as f:
            f.write(pattern(i, size))
    except OSError as e:
        while isinstance(e.__context__, OSError):
            e = e.__context__
        print("failed", i, e.errno, flush=True)
        break
    print("stored", i, flush=True)
"#;

#[test]
fn a_writer_that_runs_out_of_space_publishes_nothing() {
    maru_tests::require_root!();
    for transport in TRANSPORTS {
        let what = format!("--fuse-uring {transport}");
        let d = daemon("memfs:{dir}/pool,size=64M", "off", transport);
        std::fs::create_dir(d.path("full")).unwrap();
        let size = 3 * MIB;
        let out = stdout_of(&run_python(
            PY_FILL,
            &[d.path("full").to_str().unwrap(), &size.to_string()],
        ));
        let last = out.lines().last().unwrap_or_default().to_owned();
        let f: Vec<&str> = last.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"failed"), "{what}: never failed:\n{out}");
        let (failed, errno): (usize, i32) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        assert_eq!(
            errno,
            libc::ENOSPC,
            "{what}: k{failed} failed with errno {errno}"
        );
        assert!(
            failed >= 10,
            "{what}: a 64 MiB pool took only {failed} entries of 3 MiB"
        );
        assert_unpublished(&d, "full", &format!("k{failed}"), &what);
        for i in 0..failed {
            assert_published(&d, "full", &format!("k{i}"), &py_pattern(i, size), &what);
        }

        // A short write: one write(2) bigger than the room left gets fewer bytes than it asked
        // for (or ENOSPC); the program closes without writing the rest. Not published, and
        // close says so.
        let free = {
            let s = nix::sys::statvfs::statvfs(d.mount.as_ref().unwrap()).unwrap();
            s.blocks_available() * s.fragment_size()
        } as usize;
        let out = stdout_of(&run_python(
            r#"
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
data = pattern(1, int(sys.argv[2]))
try:
    print("wrote", os.write(fd, data), flush=True)
except OSError as e:
    print("write", e.errno, flush=True)
try:
    os.close(fd)
    print("closed", flush=True)
except OSError as e:
    print("close", e.errno, flush=True)
"#,
            &[
                d.path("full/short").to_str().unwrap(),
                &(free + 8 * MIB).to_string(),
            ],
        ));
        assert!(
            !out.contains(&format!("wrote {}", free + 8 * MIB)),
            "{what}: a write bigger than the free space was taken whole:\n{out}"
        );
        assert!(
            out.lines().any(|l| l.starts_with("close ")),
            "{what}: close succeeded after a short or failed write, yet nothing can be \
             published:\n{out}"
        );
        assert_unpublished(&d, "full", "short", &what);

        // cp of a file bigger than the free space fails and leaves nothing behind.
        let src = d.dir.join("big.bin");
        std::fs::write(&src, pattern(7, free + 4 * MIB)).unwrap();
        let cp = Command::new("cp")
            .arg(&src)
            .arg(d.path("full/x"))
            .output()
            .unwrap();
        assert!(
            !cp.status.success(),
            "{what}: cp of {} MiB into {} MiB free succeeded",
            (free + 4 * MIB) >> 20,
            free >> 20
        );
        assert_unpublished(&d, "full", "x", &format!("{what}, after cp"));
    }
}

/// Writes `size` bytes into a new file, 1 MiB per write (resuming after short writes), until a
/// write fails; prints `failed ERRNO` (`failed None` if none did), then ends as `ending` says:
/// `close` (prints `closed` or `close ERRNO`), `exit` (exits at once with the descriptor
/// open), `wait` (sleeps until killed).
const PY_FAILING_WRITER: &str = r#"
path, size, ending = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
data, off, err = pattern(5, size), 0, None
try:
    while off < size:
        off += os.write(fd, data[off:off + (1 << 20)])
except OSError as e:
    err = e.errno
print("failed", err, flush=True)
if ending == "close":
    try:
        os.close(fd)
        print("closed", flush=True)
    except OSError as e:
        print("close", e.errno, flush=True)
elif ending == "exit":
    os._exit(0)
else:
    time.sleep(600)
"#;

#[test]
fn a_failed_writer_publishes_nothing_and_leaks_nothing_however_it_ends() {
    maru_tests::require_root!();
    for transport in TRANSPORTS {
        let d = daemon("memfs:{dir}/pool,size=64M", "off", transport);
        std::fs::create_dir(d.path("w")).unwrap();
        // Fill the pool to 48 MiB through libmaru: the writers below have about 16 MiB.
        let h = d.handler();
        for i in 0..12 {
            h.put(&format!("w/fill{i}"), &pattern(i, 4 * MIB)).unwrap();
        }
        let before = (pool_used(&d), tmpfs_used(&d));
        for ending in ["close", "exit", "kill"] {
            let what = format!("--fuse-uring {transport}, a writer that ends by {ending}");
            let key = format!("k-{ending}");
            let path = d.path(&format!("w/{key}"));
            let mode = if ending == "kill" { "wait" } else { ending };
            let mut w = Talker::start(
                PY_FAILING_WRITER,
                &[path.to_str().unwrap(), &(32 * MIB).to_string(), mode],
            );
            let l = w.line();
            assert_eq!(
                l,
                format!("failed {}", libc::ENOSPC),
                "{what}: 32 MiB into 16 MiB free"
            );
            match ending {
                "close" => {
                    let l = w.line();
                    assert!(
                        l.starts_with("close "),
                        "{what}: close said `{l}` for an entry that cannot be published"
                    );
                    assert!(w.finish().success());
                }
                "exit" => assert!(w.finish().success()),
                _ => {
                    w.child.0.kill().unwrap();
                    w.child.0.wait().unwrap();
                }
            }
            assert_unpublished(&d, "w", &key, &what);
            assert_space_returns(&d, before, &what);
        }
        // The pool still takes what fits, through the mount.
        std::fs::write(d.path("w/after"), pattern(9, 4 * MIB)).unwrap();
        assert_published(&d, "w", "after", &pattern(9, 4 * MIB), transport);
    }
}

#[test]
fn writers_over_a_namespace_quota_learn_it_and_publish_nothing() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    let h = d.handler();
    h.mkdir("q", 0o777).unwrap();
    h.set_quota("q", Some(10 * MIB as u64)).unwrap();
    // Four 4 MiB entries with plain open/write/close: a line per entry, `ok I` or the first
    // error, `write I ERRNO` / `close I ERRNO` (or `open I ERRNO`: wrong, 8 MiB are not the
    // quota yet).
    let out = stdout_of(&run_python(
        r#"
ns = sys.argv[1]
for i in range(4):
    try:
        fd = os.open(os.path.join(ns, f"e{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as e:
        print(f"open {i} {e.errno}", flush=True)
        continue
    data, off, where = pattern(i, 4 << 20), 0, None
    try:
        while off < len(data):
            off += os.write(fd, data[off:])
    except OSError as e:
        where = f"write {i} {e.errno}"
    try:
        os.close(fd)
    except OSError as e:
        where = where or f"close {i} {e.errno}"
    print(where or f"ok {i}", flush=True)
"#,
        &[d.path("q").to_str().unwrap()],
    ));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert_eq!(lines[..2], ["ok 0", "ok 1"], "8 MiB fit in 10 MiB:\n{out}");
    for (i, l) in lines.iter().enumerate().skip(2) {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert!(
            matches!(f[0], "write" | "close") && f[2] == libc::EDQUOT.to_string(),
            "entry {i} (12 MiB in a 10 MiB quota) should fail with EDQUOT from write or \
             close:\n{out}"
        );
    }
    // Exactly the entries whose close succeeded exist.
    for (i, l) in lines.iter().enumerate() {
        let key = format!("e{i}");
        if l.starts_with("ok") {
            assert_published(&d, "q", &key, &py_pattern(i, 4 * MIB), "under the quota");
        } else {
            assert_unpublished(&d, "q", &key, "over the quota");
        }
    }
}

#[test]
fn a_name_taken_while_being_written_fails_its_writers_close_with_eexist() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    std::fs::create_dir(d.path("x")).unwrap();
    let h = d.handler();
    // Writes, says so, waits for a line, closes: prints `closed` or `close ERRNO`.
    const PY_SLOW_WRITER: &str = r#"
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
data = pattern(3, 1 << 20)
off = 0
while off < len(data):
    off += os.write(fd, data[off:])
print("written", flush=True)
sys.stdin.readline()
try:
    os.close(fd)
    print("closed", flush=True)
except OSError as e:
    print("close", e.errno, flush=True)
"#;
    // Another client stores the name through libmaru before the writer closes: the writer's
    // close fails with EEXIST, and the name keeps libmaru's bytes.
    let mut w = Talker::start(PY_SLOW_WRITER, &[d.path("x/k").to_str().unwrap()]);
    assert_eq!(w.line(), "written");
    let theirs = pattern(4, 300_000);
    h.put("x/k", &theirs).unwrap();
    w.tell("close");
    assert_eq!(
        w.line(),
        format!("close {}", libc::EEXIST),
        "the writer's close"
    );
    assert!(w.finish().success());
    assert_published(&d, "x", "k", &theirs, "stored through libmaru meanwhile");

    // A second process creating a name another one is still writing gets EEXIST at open;
    // the first writer then publishes its bytes.
    let mut w = Talker::start(PY_SLOW_WRITER, &[d.path("x/k2").to_str().unwrap()]);
    assert_eq!(w.line(), "written");
    let second = stdout_of(&run_python(
        r#"
try:
    with open(sys.argv[1], "xb") as f:
        f.write(b"second")
    print("created")
except OSError as e:
    print("open", e.errno)
"#,
        &[d.path("x/k2").to_str().unwrap()],
    ));
    assert_eq!(
        second.trim(),
        format!("open {}", libc::EEXIST),
        "a create of a name being written"
    );
    w.tell("close");
    assert_eq!(w.line(), "closed");
    assert!(w.finish().success());
    assert_published(&d, "x", "k2", &py_pattern(3, MIB), "the first writer's");
}

#[test]
fn an_entry_larger_than_its_pool_fails_with_efbig() {
    maru_tests::require_root!();
    for transport in TRANSPORTS {
        let what = format!("--fuse-uring {transport}");
        let d = daemon("memfs:{dir}/pool,size=64M", "lru", transport);
        std::fs::create_dir(d.path("big")).unwrap();
        // 70 MiB, 1 MiB per write: refused once past the pool's 64 MiB.
        let out = stdout_of(&run_python(
            r#"
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
chunk, off, err = b"\x5a" * (1 << 20), 0, None
try:
    while off < 70 << 20:
        off += os.write(fd, chunk[: (70 << 20) - off])
except OSError as e:
    err = e.errno
try:
    os.close(fd)
    print(off, err, "closed")
except OSError as e:
    print(off, err, "close", e.errno)
"#,
            &[d.path("big/k").to_str().unwrap()],
        ));
        let f: Vec<&str> = out.split_whitespace().collect();
        let written: usize = f[0].parse().unwrap();
        assert_eq!(
            f[1],
            libc::EFBIG.to_string(),
            "{what}: writing 70 MiB into a 64 MiB pool: {out}"
        );
        assert!(
            (56 * MIB..=64 * MIB).contains(&written),
            "{what}: EFBIG after {written} bytes, not once past 64 MiB"
        );
        assert_eq!(f[2], "close", "{what}: close succeeded: {out}");
        assert_unpublished(&d, "big", "k", &what);

        // dd says so too, and leaves nothing.
        let dd = Command::new("dd")
            .arg("if=/dev/zero")
            .arg(format!("of={}", d.path("big/dd").display()))
            .args(["bs=1M", "count=70"])
            .output()
            .unwrap();
        assert!(!dd.status.success(), "{what}: dd of 70 MiB succeeded");
        assert_unpublished(&d, "big", "dd", &format!("{what}, dd"));
    }
}

#[test]
fn every_entry_whose_close_succeeded_is_published_at_once() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts::default());
    std::fs::create_dir(d.path("ok")).unwrap();
    let sizes: [usize; 20] = [
        1,
        100,
        4095,
        4096,
        4097,
        65_536,
        100_000,
        MIB - 1,
        MIB,
        MIB + 1,
        2 * MIB - 1,
        2 * MIB,
        2 * MIB + 4096,
        3 * MIB + 7,
        4 * MIB,
        5_000_000,
        6 * MIB,
        7 * MIB + 1,
        8 * MIB,
        12_345,
    ];
    let mut args = vec![d.path("ok").to_string_lossy().into_owned()];
    args.extend(sizes.iter().map(usize::to_string));
    // Entry i is written with write() (even i) or ftruncate + mmap (odd i); after its close
    // returns, the program says `closed I` and waits until told to go on.
    let mut w = Talker::start(
        r#"
ns, sizes = sys.argv[1], [int(s) for s in sys.argv[2:]]
for i, size in enumerate(sizes):
    fd = os.open(os.path.join(ns, f"e{i}"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    data = pattern(i, size)
    if i % 2 == 0:
        off = 0
        while off < size:
            off += os.write(fd, data[off:])
    else:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        m[:] = data
        m.close()
    os.close(fd)
    print("closed", i, flush=True)
    sys.stdin.readline()
"#,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let h = d.handler();
    for (i, size) in sizes.into_iter().enumerate() {
        assert_eq!(w.line(), format!("closed {i}"));
        // No sleep: the writer's close has returned, the entry must be there for others.
        let key = format!("ok/e{i}");
        assert!(h.exists(&key).unwrap(), "{key} not visible after close");
        let how = if i % 2 == 0 { "write()" } else { "mmap" };
        assert_published(&d, "ok", &format!("e{i}"), &py_pattern(i, size), how);
        w.tell("go on");
    }
    assert!(w.finish().success());
}
