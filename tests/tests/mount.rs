//! The /maru filesystem against a real mount (issue: FUSE filesystem).
//! Each claim of doc/SEMANTICS.md names the test that backs it.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use maru_tests::{Daemon, Opts, pattern, pfns, set_xattr, xattr};

fn daemon() -> Daemon {
    Daemon::start(Opts::default())
}

/// How many requests of kind `op` (`"fuse_open"`, ...) marud has served through the mount.
fn fuse_ops(d: &Daemon, op: &str) -> u64 {
    d.handler()
        .stats()
        .unwrap()
        .ops
        .get(op)
        .copied()
        .unwrap_or(0)
}

/// Writes a sealed entry of `size` pattern bytes at `ns/key` (the namespace is created), and
/// waits for its publication.
fn sealed_entry(d: &Daemon, ns: &str, key: &str, seed: u64, size: usize) -> std::path::PathBuf {
    std::fs::create_dir(d.path(ns)).unwrap();
    let rel = format!("{ns}/{key}");
    std::fs::write(d.path(&rel), pattern(seed, size)).unwrap();
    d.published(&rel)
}

fn python(code: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Python's writer: open, ftruncate, mmap, write, close.
const PY_STORE: &str = r#"
import mmap, os, sys
path, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
block = bytes((i + seed) % 251 for i in range(251))
data = (block * (size // 251 + 1))[:size]
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
os.ftruncate(fd, size)
m = mmap.mmap(fd, size)
m[:] = data
m.close()
os.close(fd)
"#;

const PY_READ: &str = r#"
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print(len(m), hashlib.sha256(m).hexdigest())
    m.close()
"#;

fn py_pattern(size: usize, seed: usize) -> Vec<u8> {
    (0..size).map(|i| ((i % 251 + seed) % 251) as u8).collect()
}

fn sha256_hex(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn python_stores_python_and_rust_retrieve() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("llama")).unwrap();
    let p = d.path("llama/chunk0");
    let size = 4 << 20;
    python(PY_STORE, &[p.to_str().unwrap(), &size.to_string(), "3"]);
    let expect = py_pattern(size, 3);
    // Another Python process.
    let out = python(PY_READ, &[p.to_str().unwrap()]);
    let mut it = out.split_whitespace();
    assert_eq!(it.next().unwrap(), size.to_string());
    assert_eq!(it.next().unwrap(), sha256_hex(&p));
    // A Rust process through the mount, and through libmaru: one store, two doors.
    let f = File::open(&p).unwrap();
    // SAFETY: read-only mapping of a sealed entry.
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    assert_eq!(&m[..], &expect[..]);
    let h = d.handler();
    assert_eq!(
        h.retrieve("llama/chunk0").unwrap().unwrap().as_slice(),
        &expect[..]
    );
    // And the other way: stored through libmaru, read through the mount.
    h.put("llama/from-lib", &pattern(5, 100_000)).unwrap();
    assert_eq!(
        std::fs::read(d.path("llama/from-lib")).unwrap(),
        pattern(5, 100_000)
    );
}

#[test]
fn mount_mapping_is_the_pool_page() {
    maru_tests::require_root!();
    let d = daemon();
    let size = 8 << 20;
    let p = sealed_entry(&d, "pfn", "k", 1, size);
    let via_mount = File::open(&p).unwrap();
    let backing = File::open(d.pool_dir().join("n/pfn/k")).unwrap();
    // SAFETY: read-only mappings of a sealed entry.
    let (a, b) = unsafe {
        (
            memmap2::Mmap::map(&via_mount).unwrap(),
            memmap2::Mmap::map(&backing).unwrap(),
        )
    };
    assert_eq!(&a[..], &b[..]);
    let pa = pfns(a.as_ptr(), size);
    let pb = pfns(b.as_ptr(), size);
    assert!(pa[0] != 0, "PFNs are zero: not root?");
    assert_eq!(pa, pb, "the mount's mapping is not the pool's pages");
    // The entry says how it is served.
    let access = xattr(&p, "user.maru.access").unwrap();
    assert_eq!(access, b"passthrough");
    // The daemon counts the requests the mount sent it: a sealed entry opened read-only
    // again is one OPEN (the lookup and attributes come from the kernel's cache).
    let (opens, lookups) = (fuse_ops(&d, "fuse_open"), fuse_ops(&d, "fuse_lookup"));
    assert!(opens > 0, "fuse_open counted");
    drop(File::open(&p).unwrap());
    assert_eq!(fuse_ops(&d, "fuse_open"), opens + 1);
    assert_eq!(fuse_ops(&d, "fuse_lookup"), lookups);
}

/// A fresh process maps an entry as engines do, with a plain `mmap(NULL, size)`, reads a byte
/// of every page, and prints the mapping's address and its `ShmemPmdMapped` (kB) from
/// `/proc/self/smaps`. A process of its own: in the test's, other tests' threads map and unmap
/// all the time, and a page table one of them leaves in the range (empty) makes the kernel map
/// that 2 MiB with small pages.
const PY_PMD: &str = r#"
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
assert sum(ctypes.string_at(addr + i, 1)[0] for i in range(0, size, 4096)) > 0
start = "%x-" % addr
lines = open("/proc/self/smaps").read().splitlines()
i = next(n for n, l in enumerate(lines) if l.startswith(start))
pmd = next(l.split()[1] for l in lines[i + 1:] if l.startswith("ShmemPmdMapped:"))
print(addr, pmd)
"#;

#[test]
fn a_plain_mapping_of_a_large_entry_uses_2mib_pages() {
    maru_tests::require_root!();
    // Engines (and the Python package) map an entry with a plain mmap(NULL, size): the
    // kernel places it at a 2 MiB boundary, FUSE file or not, so the pool's 2 MiB pages are
    // mapped with one page-table entry each.
    let d = daemon();
    let size: u64 = 16 << 20;
    let p = sealed_entry(&d, "huge", "k", 3, size as usize);
    let out = python(PY_PMD, &[p.to_str().unwrap()]);
    let (addr, pmd) = out.trim().split_once(' ').expect("ADDR KIB");
    let (addr, pmd): (u64, u64) = (addr.parse().unwrap(), pmd.parse().unwrap());
    assert_eq!(addr % (2 << 20), 0, "mapping not 2 MiB-aligned");
    assert_eq!(
        pmd,
        size >> 10,
        "the entry's pages are not mapped 2 MiB at a time"
    );
}

/// Another process polls the name while this one writes it slowly.
const PY_RACE: &str = r#"
import os, sys, time
path, size, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
full = 0
while True:
    done = os.path.exists(stop)
    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != size:
            print("partial", len(data)); sys.exit(1)
        if data != bytes((i * 7 + 3) % 256 for i in range(256)) * (size // 256):
            print("torn"); sys.exit(1)
        full += 1
    except FileNotFoundError:
        pass
    if done and full:
        break
print("ok", full)
"#;

#[test]
fn readers_never_see_a_partial_entry() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("race")).unwrap();
    let size = 2 << 20;
    let block: Vec<u8> = (0..256u32).map(|i| ((i * 7 + 3) % 256) as u8).collect();
    let data: Vec<u8> = block.iter().copied().cycle().take(size).collect();
    for round in 0..4 {
        let p = d.path(&format!("race/k{round}"));
        let stop = d.dir.join(format!("stop{round}"));
        let reader = Command::new("python3")
            .arg("-c")
            .arg(PY_RACE)
            .args([
                p.to_str().unwrap(),
                &size.to_string(),
                stop.to_str().unwrap(),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
            .unwrap();
        for chunk in data.chunks(128 << 10) {
            f.write_all(chunk).unwrap();
            // The writer itself sees its entry while writing it.
            assert!(p.exists());
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(f);
        std::fs::write(&stop, b"").unwrap();
        let out = reader.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.starts_with("ok"),
            "reader saw: {text}"
        );
    }
}

#[test]
fn sealed_entries_are_immutable() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("ro")).unwrap();
    let p = d.path("ro/k");
    std::fs::write(&p, b"original").unwrap();
    d.published("ro/k");
    // An entry keeps the mode it was created with (here 0666 & umask); sealed, it is
    // immutable whatever the mode says.
    let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o444, 0o444, "{mode:o}");
    for opts in [
        OpenOptions::new().write(true).clone(),
        OpenOptions::new().append(true).clone(),
        OpenOptions::new().write(true).truncate(true).clone(),
        OpenOptions::new().read(true).write(true).clone(),
    ] {
        let e = opts.open(&p).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    }
    let e = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    let e = File::open(&p).unwrap().set_len(1).unwrap_err();
    assert!(
        e.raw_os_error() == Some(libc::EPERM)
            || e.raw_os_error() == Some(libc::EBADF)
            || e.raw_os_error() == Some(libc::EINVAL),
        "{e}"
    );
    let e = std::fs::write(&p, b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    assert_eq!(std::fs::read(&p).unwrap(), b"original");
    // Overwriting by rename is refused too: entries are write-once.
    std::fs::write(d.path("ro/other"), b"other").unwrap();
    let e = std::fs::rename(d.path("ro/other"), &p).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    assert_eq!(std::fs::read(&p).unwrap(), b"original");
}

#[test]
fn unlink_while_mapped_keeps_bytes() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("u")).unwrap();
    let p = d.path("u/k");
    let data = pattern(9, 3 << 20);
    std::fs::write(&p, &data).unwrap();
    let f = File::open(d.published("u/k")).unwrap();
    // SAFETY: read-only mapping of a sealed entry.
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    // Opened before (its backing kept for the next open) and held open across the unlink.
    drop(File::open(&p).unwrap());
    std::fs::remove_file(&p).unwrap();
    assert_eq!(
        std::fs::metadata(&p).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert!(!d.pool_dir().join("n/u/k").exists());
    assert!(m[..] == data[..]);
    // The held descriptor still reads; opening the deleted entry again (through
    // /proc/self/fd, which skips the name) is refused: a deleted entry is gone.
    let mut head = [0u8; 16];
    f.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(head[..], data[..16]);
    let again = File::open(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap_err();
    assert_eq!(again.raw_os_error(), Some(libc::ENOENT));
    drop(f);
    // Deleted through libmaru while mapped through the mount: same guarantee, and the
    // kernel forgets the name at once (no stale cached entry).
    let h = d.handler();
    h.put("u/k2", &data).unwrap();
    let f = File::open(d.path("u/k2")).unwrap();
    // SAFETY: as above.
    let m2 = unsafe { memmap2::Mmap::map(&f).unwrap() };
    assert!(std::fs::metadata(d.path("u/k2")).is_ok());
    h.delete("u/k2").unwrap();
    let t = std::time::Instant::now();
    while std::fs::metadata(d.path("u/k2")).is_ok() {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "stale name after delete"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m2[..] == data[..]);
}

#[test]
fn df_shows_the_pool() {
    maru_tests::require_root!();
    let d = daemon();
    let s = nix::sys::statvfs::statvfs(d.mount.as_ref().unwrap()).unwrap();
    let total = s.blocks() * s.fragment_size();
    assert_eq!(total, 256 << 20);
    std::fs::create_dir(d.path("df")).unwrap();
    std::fs::write(d.path("df/k"), pattern(1, 16 << 20)).unwrap();
    let s2 = nix::sys::statvfs::statvfs(d.mount.as_ref().unwrap()).unwrap();
    let used = (s2.blocks() - s2.blocks_free()) * s2.fragment_size();
    assert!(used >= 16 << 20, "used {used}");
    let out = Command::new("df")
        .arg("-B1")
        .arg(d.mount.as_ref().unwrap())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("maru") && text.contains(&(256u64 << 20).to_string()),
        "{text}"
    );
}

#[test]
fn names_too_long_and_unsupported_ops() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("n")).unwrap();
    let long = d.path(&format!("n/{}", "x".repeat(256)));
    let e = File::create(&long).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG));
    let ok = d.path(&format!("n/{}", "y".repeat(255)));
    std::fs::write(&ok, b"fine").unwrap();
    assert_eq!(std::fs::read(&ok).unwrap(), b"fine");
    std::fs::write(d.path("n/t"), b"t").unwrap();
    let e = std::os::unix::fs::symlink("t", d.path("n/l")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    let e = std::fs::hard_link(d.path("n/t"), d.path("n/h")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    // Names are UTF-8 (as over the socket, which speaks JSON).
    use std::os::unix::ffi::OsStrExt;
    let bad = d.path("n").join(std::ffi::OsStr::from_bytes(b"k\xff\xfe"));
    let e = File::create(&bad).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    // Entries live in namespaces, not at the root.
    let e = File::create(d.path("rootfile")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    // rmdir of a non-empty namespace.
    let e = std::fs::remove_dir(d.path("n")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
}

#[test]
fn other_users_cannot_touch_a_private_namespace() {
    maru_tests::require_root!();
    let d = daemon();
    // Let others reach the mount point itself.
    std::fs::set_permissions(&d.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(d.path("private")).unwrap();
    std::fs::set_permissions(d.path("private"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(d.path("private/secret"), b"secret").unwrap();
    std::fs::create_dir(d.path("open")).unwrap();
    std::fs::set_permissions(d.path("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let as_nobody = |script: &str| {
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sh",
                "-c",
                script,
            ])
            .output()
            .unwrap()
    };
    let secret = d.path("private/secret");
    for script in [
        format!("cat {}", secret.display()),
        format!("echo x > {}", d.path("private/new").display()),
        format!("rm -f {}", secret.display()),
        format!("ls {}", d.path("private").display()),
        format!("setfattr -n user.maru.pinned -v 1 {}", secret.display()),
    ] {
        let out = as_nobody(&script);
        assert!(!out.status.success(), "nobody could run `{script}`");
    }
    assert_eq!(std::fs::read(&secret).unwrap(), b"secret");
    assert!(!d.path("private/new").exists());
    // The same user may use a namespace open to everyone, and owns what it stores.
    let out = as_nobody(&format!(
        "echo hi > {} && cat {}",
        d.path("open/mine").display(),
        d.path("open/mine").display()
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(d.path("open/mine")).unwrap().uid(), 65534);
}

#[test]
fn xattrs_show_state_and_pin() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("x")).unwrap();
    let p = d.path("x/k");
    std::fs::write(&p, b"abc").unwrap();
    d.published("x/k");
    let before = fuse_ops(&d, "fuse_getxattr");
    assert_eq!(xattr(&p, "user.maru.state").unwrap(), b"sealed");
    assert_eq!(
        fuse_ops(&d, "fuse_getxattr"),
        before + 1,
        "marud counts the GETXATTR it served"
    );
    assert_eq!(xattr(&p, "user.maru.size").unwrap(), b"3");
    assert_eq!(xattr(&p, "user.maru.pinned").unwrap(), b"0");
    assert!(
        xattr(&p, "user.maru.location")
            .unwrap()
            .ends_with(b"/n/x/k")
    );
    set_xattr(&p, "user.maru.pinned", b"1").unwrap();
    assert_eq!(xattr(&p, "user.maru.pinned").unwrap(), b"1");
    assert!(d.handler().is_pinned("x/k").unwrap());
    let e = set_xattr(&p, "user.maru.size", b"9").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    let out = Command::new("getfattr")
        .args(["-d", "-m", "user.maru"])
        .arg(&p)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("user.maru.state=\"sealed\""), "{text}");
}

#[test]
fn entries_never_carry_setuid_bits_and_writes_ask_no_xattrs() {
    maru_tests::require_root!();
    use std::os::unix::fs::OpenOptionsExt;
    let d = daemon();
    std::fs::create_dir(d.path("s")).unwrap();
    let p = d.path("s/e");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o6755)
        .open(&p)
        .unwrap();
    assert_eq!(mode(&p), 0o755, "set-user/group-ID dropped at create");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o4644)).unwrap();
    assert_eq!(mode(&p), 0o644, "and by chmod while written");
    // Nothing to kill on a write, and the kernel knows it (FUSE_HANDLE_KILLPRIV_V2): it
    // checks the file's security attributes once, not before every write(2).
    let before = fuse_ops(&d, "fuse_getxattr");
    for _ in 0..16 {
        f.write_all(&[7u8; 65536]).unwrap();
    }
    let asked = fuse_ops(&d, "fuse_getxattr") - before;
    assert!(asked <= 1, "{asked} GETXATTR for 16 writes");
    drop(f);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o6444)).unwrap();
    assert_eq!(mode(&p), 0o444, "and by chmod once sealed");
    assert_eq!(std::fs::read(&p).unwrap(), vec![7u8; 16 * 65536]);
}

#[test]
fn rename_publishes_a_temp_name_and_tools_work() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("t")).unwrap();
    // Write under a temp name, rename onto the key.
    let tmp = d.path("t/.k.tmp");
    std::fs::write(&tmp, pattern(2, 70_000)).unwrap();
    std::fs::rename(&tmp, d.path("t/k")).unwrap();
    assert!(!tmp.exists());
    assert_eq!(std::fs::read(d.path("t/k")).unwrap(), pattern(2, 70_000));
    assert!(d.handler().exists("t/k").unwrap());
    // Renamed while still open for writing: published under the new name at close.
    let mut f = File::create(d.path("t/.w")).unwrap();
    std::fs::rename(d.path("t/.w"), d.path("t/w")).unwrap();
    f.write_all(b"late").unwrap();
    drop(f);
    assert_eq!(std::fs::read(d.path("t/w")).unwrap(), b"late");
    // cp in and out, ls, du, find, stat.
    let src = d.dir.join("src.bin");
    std::fs::write(&src, pattern(3, 1 << 20)).unwrap();
    assert!(
        Command::new("cp")
            .arg(&src)
            .arg(d.path("t/copied"))
            .status()
            .unwrap()
            .success()
    );
    let back = d.dir.join("back.bin");
    assert!(
        Command::new("cp")
            .arg(d.path("t/copied"))
            .arg(&back)
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(std::fs::read(&back).unwrap(), pattern(3, 1 << 20));
    let ls = Command::new("ls")
        .arg("-l")
        .arg(d.path("t"))
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout);
    assert!(ls.contains("copied") && ls.contains("1048576"), "{ls}");
    let find = Command::new("find")
        .arg(d.mount.as_ref().unwrap())
        .arg("-type")
        .arg("f")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&find.stdout).lines().count(), 3);
    let du = Command::new("du")
        .arg("-sb")
        .arg(d.path("t"))
        .output()
        .unwrap();
    assert!(du.status.success());
    // Directories cannot be renamed in place (EXDEV makes `mv` copy instead).
    std::fs::create_dir(d.path("t2")).unwrap();
    let e = std::fs::rename(d.path("t2"), d.path("t3")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
    let f = File::open(d.path("t/k")).unwrap();
    let mut buf = [0u8; 10];
    f.read_exact_at(&mut buf, 100).unwrap();
    assert_eq!(&buf, &pattern(2, 70_000)[100..110]);
}

#[test]
fn crash_leaves_a_dead_mount_that_restart_replaces() {
    maru_tests::require_root!();
    let mut d = daemon();
    std::fs::create_dir(d.path("c")).unwrap();
    std::fs::write(d.path("c/k"), pattern(4, 10_000)).unwrap();
    // Another process sees it once published (its lookup waits for the release).
    assert!(
        Command::new("test")
            .arg("-e")
            .arg(d.path("c/k"))
            .status()
            .unwrap()
            .success()
    );
    d.kill9();
    // A request caught by the teardown of the dead daemon's io_uring queues fails with
    // ECONNABORTED or ECANCELED; once the connection is gone, every request fails with
    // ENOTCONN.
    let mut e = std::fs::metadata(d.path("c/k")).unwrap_err();
    for _ in 0..50 {
        if e.raw_os_error() == Some(libc::ENOTCONN) {
            break;
        }
        assert!(
            matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::ECANCELED)),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(10));
        e = std::fs::metadata(d.path("c/k")).unwrap_err();
    }
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    d.restart();
    assert_eq!(std::fs::read(d.path("c/k")).unwrap(), pattern(4, 10_000));
    // SIGTERM unmounts cleanly.
    let mnt = d.mount.clone().unwrap();
    d.stop();
    assert!(!maru_tests::is_mounted(&mnt));
}

#[test]
fn eviction_removes_names_from_the_mount() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=16M".into()],
        mount: true,
        extra: vec![],
    });
    std::fs::create_dir(d.path("ev")).unwrap();
    std::fs::write(d.path("ev/old"), pattern(1, 4 << 20)).unwrap();
    assert!(d.published("ev/old").exists());
    let h = d.handler();
    for i in 0..6 {
        h.put(&format!("ev/n{i}"), &pattern(i, 4 << 20)).unwrap();
    }
    assert!(
        !d.path("ev/old").exists(),
        "an evicted entry is still visible"
    );
    let n = std::fs::read_dir(d.path("ev")).unwrap().count();
    assert!(n <= 4, "{n} entries in a 16M pool of 4M entries");
}

#[test]
fn writers_through_the_mount_evict_when_the_pool_is_full() {
    maru_tests::require_root!();
    // 256 MiB pool, 16 MiB entries: writing 40 of them (640 MiB) through the mount only works
    // if the daemon evicts for the writes it serves.
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=256M".into()],
        mount: true,
        extra: vec!["--eviction".into(), "lru".into()],
    });
    std::fs::create_dir(d.path("full")).unwrap();
    for i in 0..40 {
        std::fs::write(d.path(&format!("full/k{i}")), pattern(i, 16 << 20))
            .unwrap_or_else(|e| panic!("writing entry {i} through the mount: {e}"));
    }
    // The newest entries are there and intact, the oldest were evicted.
    assert_eq!(
        std::fs::read(d.path("full/k39")).unwrap(),
        pattern(39, 16 << 20)
    );
    assert!(
        !d.path("full/k0").exists(),
        "the oldest entry was not evicted"
    );
    let n = std::fs::read_dir(d.path("full")).unwrap().count();
    assert!(
        (8..=16).contains(&n),
        "{n} entries of 16 MiB in a 256 MiB pool"
    );
    // A writer that sizes its entry first (ftruncate, then fills it through a mapping, where a
    // full tmpfs would mean SIGBUS) or reserves it (fallocate) gets the room for it.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(d.path("full/sized"))
        .unwrap();
    f.set_len(160 << 20).unwrap();
    // SAFETY: a shared writable mapping of a file only this test uses.
    let mut m = unsafe { memmap2::MmapMut::map_mut(&f).unwrap() };
    m.copy_from_slice(&pattern(50, 160 << 20));
    drop(m);
    drop(f);
    assert_eq!(
        std::fs::read(d.path("full/sized")).unwrap(),
        pattern(50, 160 << 20)
    );
    let f = File::create(d.path("full/reserved")).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on an open descriptor.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 160 << 20) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
    f.write_all_at(&pattern(51, 160 << 20), 0).unwrap();
    drop(f);
    assert!(
        !d.path("full/sized").exists(),
        "the older big entry made room"
    );
    assert_eq!(
        std::fs::read(d.path("full/reserved")).unwrap(),
        pattern(51, 160 << 20)
    );
}

#[test]
fn unlink_through_the_mount_frees_pool_memory() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("rm")).unwrap();
    let used = |d: &Daemon| {
        let s = nix::sys::statvfs::statvfs(d.pool_dir()).unwrap();
        (s.blocks() - s.blocks_free()) * s.fragment_size()
    };
    let before = used(&d);
    for i in 0..4 {
        std::fs::write(d.path(&format!("rm/k{i}")), pattern(i, 16 << 20)).unwrap();
        // Read it through the mount, so the mount holds a passthrough backing for it.
        assert_eq!(
            std::fs::read(d.path(&format!("rm/k{i}"))).unwrap().len(),
            16 << 20
        );
    }
    assert!(used(&d) >= before + (60 << 20), "64 MiB written");
    for i in 0..4 {
        std::fs::remove_file(d.path(&format!("rm/k{i}"))).unwrap();
    }
    let t = std::time::Instant::now();
    while used(&d) > before + (8 << 20) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "unlinked entries still hold {} MiB of the pool",
            (used(&d) - before) >> 20
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn eviction_off_gives_enospc_through_the_mount() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: true,
        extra: vec!["--eviction".into(), "off".into()],
    });
    std::fs::create_dir(d.path("full")).unwrap();
    let mut err = None;
    for i in 0..8 {
        if let Err(e) = std::fs::write(d.path(&format!("full/k{i}")), pattern(i, 16 << 20)) {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("a 64 MiB pool took 128 MiB");
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    assert!(d.path("full/k0").exists(), "nothing may be evicted");
}

#[test]
fn a_child_closing_an_inherited_copy_does_not_publish() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("fork")).unwrap();
    let p = d.path("fork/k");
    let mut f = File::create(&p).unwrap();
    f.write_all(b"part").unwrap();
    // The child inherits the descriptor until its exec closes it (O_CLOEXEC): that close
    // must not publish the entry.
    assert!(Command::new("true").status().unwrap().success());
    let seen = Command::new("test").arg("-e").arg(&p).status().unwrap();
    assert!(!seen.success(), "published by a child's close");
    f.write_all(b"rest").unwrap();
    drop(f);
    assert_eq!(std::fs::read(&p).unwrap(), b"partrest");
    let seen = Command::new("test").arg("-e").arg(&p).status().unwrap();
    assert!(seen.success(), "not visible after the writer's close");
}

#[test]
fn raw_pool_entries_are_served_by_copying() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["file:{dir}/dev.img,size=64M".into()],
        mount: true,
        extra: vec![],
    });
    std::fs::create_dir(d.path("raw")).unwrap();
    let data = pattern(11, 3 << 20);
    std::fs::write(d.path("raw/k"), &data).unwrap();
    d.published("raw/k");
    assert_eq!(std::fs::read(d.path("raw/k")).unwrap(), data);
    assert_eq!(
        xattr(&d.path("raw/k"), "user.maru.access").unwrap(),
        b"copy"
    );
    assert_eq!(xattr(&d.path("raw/k"), "user.maru.kind").unwrap(), b"file");
    // Both doors: libmaru maps the same bytes from the device.
    let h = d.handler();
    assert_eq!(h.retrieve("raw/k").unwrap().unwrap().as_slice(), &data[..]);
    h.put("raw/lib", &pattern(12, 5000)).unwrap();
    assert_eq!(std::fs::read(d.path("raw/lib")).unwrap(), pattern(12, 5000));
    // mmap of a copy-served file works too (through the page cache of the FUSE inode).
    let f = File::open(d.path("raw/lib")).unwrap();
    // SAFETY: read-only mapping of a sealed entry.
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    assert_eq!(&m[..], &pattern(12, 5000)[..]);
}

#[test]
fn libmaru_sees_an_entry_as_soon_as_its_writer_closed_it() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("now")).unwrap();
    let h = d.handler();
    assert!(!h.exists("now/k0").unwrap());
    for i in 0..50u64 {
        std::fs::write(d.path(&format!("now/k{i}")), pattern(i, 20_000)).unwrap();
        // No sleep: the close has returned, the kernel's release may still be in flight.
        assert!(
            h.exists(&format!("now/k{i}")).unwrap(),
            "k{i} not visible after close"
        );
        let m = h
            .retrieve(&format!("now/k{i}"))
            .unwrap()
            .expect("retrievable after close");
        assert_eq!(m.as_slice(), &pattern(i, 20_000)[..]);
    }
    assert!(!h.exists("now/never").unwrap());
}

/// The verbs that act on an entry find it once its writer's `close` returned, though marud
/// publishes it only at the kernel's release of the last descriptor: here a copy of the
/// writer's descriptor is closed 200 ms after the writer's `close`, and each verb waits for
/// the publication (a `close` commits the entry, so marud knows it is coming).
#[test]
fn libmaru_acts_on_an_entry_as_soon_as_its_writer_closed_it() {
    maru_tests::require_root!();
    let d = daemon();
    std::fs::create_dir(d.path("now")).unwrap();
    let h = d.handler();
    let closed_but_held = |key: &str| {
        let mut f = File::create_new(d.path(key)).unwrap();
        f.write_all(&pattern(1, 8192)).unwrap();
        let copy = f.try_clone().unwrap();
        drop(f);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(copy);
        })
    };
    let t = closed_but_held("now/pinned");
    h.pin("now/pinned").unwrap();
    assert!(h.is_pinned("now/pinned").unwrap());
    t.join().unwrap();
    let t = closed_but_held("now/listed");
    let (_, _, entries) = h.list("now").unwrap();
    assert!(entries.iter().any(|e| e.key == "listed"), "{entries:?}");
    t.join().unwrap();
    let t = closed_but_held("now/deleted");
    h.delete("now/deleted").unwrap();
    assert!(!h.exists("now/deleted").unwrap());
    t.join().unwrap();
}

/// Names of a process's threads, with their allowed CPUs.
fn threads_of(pid: u32) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap().path();
        let comm = std::fs::read_to_string(t.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(t.join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or("")
            .trim()
            .to_string();
        v.push((comm.trim().to_string(), cpus));
    }
    v
}

#[test]
fn requests_come_over_io_uring_one_queue_per_cpu() {
    maru_tests::require_root!();
    if !Path::new("/sys/module/fuse/parameters/enable_uring").exists() {
        eprintln!("skipped: this kernel has no FUSE over io_uring");
        return;
    }
    let d = daemon();
    // One queue thread per possible CPU, pinned to it.
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    let last: usize = possible
        .trim()
        .rsplit(['-', ','])
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let mut rings: Vec<(String, String)> = threads_of(d.pid())
        .into_iter()
        .filter(|(n, _)| n.starts_with("maru-ring"))
        .collect();
    rings.sort();
    assert_eq!(rings.len(), last + 1, "{rings:?}");
    for (name, cpus) in &rings {
        assert_eq!(name.strip_prefix("maru-ring").unwrap(), cpus, "{rings:?}");
    }
    // Served through them: a store, a retrieval that maps the pool's pages.
    std::fs::create_dir(d.path("u")).unwrap();
    std::fs::write(d.path("u/k"), pattern(3, 4 << 20)).unwrap();
    let f = File::open(d.published("u/k")).unwrap();
    // SAFETY: read-only mapping of a sealed entry.
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    assert_eq!(&m[..], &pattern(3, 4 << 20)[..]);
    let backing = File::open(d.pool_dir().join("n/u/k")).unwrap();
    // SAFETY: as above.
    let b = unsafe { memmap2::Mmap::map(&backing).unwrap() };
    assert_eq!(pfns(m.as_ptr(), 4 << 20), pfns(b.as_ptr(), 4 << 20));
    assert_eq!(
        std::fs::read_dir(d.path("u")).unwrap().count(),
        1,
        "readdir over the ring"
    );
}

#[test]
fn dev_fuse_serves_the_mount_when_io_uring_is_off() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        extra: vec!["--fuse-uring".into(), "off".into()],
        ..Opts::default()
    });
    assert!(
        !threads_of(d.pid())
            .iter()
            .any(|(n, _)| n.starts_with("maru-ring"))
    );
    std::fs::create_dir(d.path("o")).unwrap();
    std::fs::write(d.path("o/k"), pattern(5, 4 << 20)).unwrap();
    let f = File::open(d.published("o/k")).unwrap();
    // SAFETY: read-only mappings of a sealed entry.
    let (m, b) = unsafe {
        (
            memmap2::Mmap::map(&f).unwrap(),
            memmap2::Mmap::map(&File::open(d.pool_dir().join("n/o/k")).unwrap()).unwrap(),
        )
    };
    assert_eq!(&m[..], &pattern(5, 4 << 20)[..]);
    assert_eq!(pfns(m.as_ptr(), 4 << 20), pfns(b.as_ptr(), 4 << 20));
    let e = OpenOptions::new()
        .write(true)
        .open(d.path("o/k"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}

#[test]
fn small_files_through_the_mount_pack_a_raw_pool() {
    maru_tests::require_root!();
    // Regression: every file written through the mount took a 2 MiB region of a raw pool of
    // its own (a 4 GiB pool was full after 2047 files of 4 KiB); they are packed now, as a
    // client's allocations are. The pool is big enough for 300 regions, so a regression
    // shows as used bytes, not as a write failing.
    let d = Daemon::start(Opts {
        pools: vec!["file:{dir}/dev.img,size=1G".into()],
        mount: true,
        extra: vec![],
    });
    std::fs::create_dir(d.path("small")).unwrap();
    let (n, size) = (300u64, 4096usize);
    for i in 0..n {
        std::fs::write(d.path(&format!("small/k{i}")), pattern(i, size))
            .unwrap_or_else(|e| panic!("writing small/k{i} through the mount: {e}"));
    }
    let pools = d.handler().stats().unwrap().pools;
    assert_eq!(pools.len(), 1);
    let pool = &pools[0];
    assert_eq!(pool.entries, n, "{pool:?}");
    let most = n * size as u64 + (4 << 20);
    assert!(
        pool.used >= n * size as u64 && pool.used <= most,
        "{n} files of {size} bytes take {} bytes of the raw pool (at most {most} expected)",
        pool.used
    );
    // df through the mount says the same.
    let s = nix::sys::statvfs::statvfs(d.mount.as_ref().unwrap()).unwrap();
    let df_used = (s.blocks() - s.blocks_free()) * s.fragment_size();
    assert!(df_used <= most, "df: {df_used} bytes used");
    // Packed, the entries keep their own bytes, through both doors.
    let h = d.handler();
    for i in [0, 1, n / 2, n - 1] {
        let p = format!("small/k{i}");
        assert_eq!(std::fs::read(d.path(&p)).unwrap(), pattern(i, size), "{p}");
        assert_eq!(
            h.retrieve(&p).unwrap().unwrap().as_slice(),
            &pattern(i, size)[..],
            "{p}"
        );
    }
}

/// The keys under `dir` (a namespace through the mount), decoded from the entry names;
/// a long key's `%+` segment namespaces are descended into.
fn keys_under(dir: &Path, prefix: &str, out: &mut Vec<Vec<u8>>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        let name = name.to_str().expect("entry names are UTF-8");
        let rel = format!("{prefix}{name}");
        if e.file_type().unwrap().is_dir() {
            assert!(
                name.ends_with(maru::key::CONTINUED),
                "{rel}: a namespace that is not a long key's segment"
            );
            keys_under(&e.path(), &format!("{rel}/"), out);
        } else {
            out.push(
                maru::key::decode(&rel).unwrap_or_else(|e| panic!("{rel} does not decode: {e}")),
            );
        }
    }
}

#[test]
fn awkward_keys_are_the_same_entries_through_libmaru_and_the_mount() {
    maru_tests::require_root!();
    let d = daemon();
    let mnt = d.mount.clone().unwrap();
    let long: Vec<u8> = (0..1024).map(|i| b"long-key/%.\xce\xba"[i % 13]).collect();
    let keys: Vec<Vec<u8>> = vec![
        b"model/layer/0".to_vec(),
        b"50%".to_vec(),
        b"%2F-is-not-a-slash".to_vec(),
        b".hidden".to_vec(),
        b"..".to_vec(),
        b".".to_vec(),
        "κλειδί/ü".as_bytes().to_vec(),
        vec![0xff, 0xfe, b'k', 0x80, b'/', 0xc3],
        long.clone(),
    ];
    // The long key's name nests in segment namespaces (`seg%+/…`), which the listing below
    // has to descend into.
    assert!(maru::key::segment_namespaces(&maru::key::path("keys", &long)).len() >= 4);
    // Stored through libmaru, half with put, half with alloc + store.
    std::fs::create_dir(d.path("keys")).unwrap();
    let h = d.handler();
    for (i, key) in keys.iter().enumerate() {
        let path = maru::key::path("keys", key);
        let data = pattern(i as u64, 3000 + i * 1000);
        if i % 2 == 0 {
            h.put(&path, &data).unwrap();
        } else {
            let mut a = h.alloc(data.len() as u64).unwrap();
            a.as_mut_slice()[..data.len()].copy_from_slice(&data);
            h.store(&path, a).unwrap();
        }
    }
    // Read through the mount by their encoded paths.
    for (i, key) in keys.iter().enumerate() {
        let path = maru::key::path("keys", key);
        let data = pattern(i as u64, 3000 + i * 1000);
        assert_eq!(
            std::fs::read(mnt.join(&path)).unwrap_or_else(|e| panic!("{path}: {e}")),
            data,
            "{path}"
        );
    }
    // Listed through the mount, the names decode to the keys, and to nothing else.
    let mut listed = Vec::new();
    keys_under(&d.path("keys"), "", &mut listed);
    listed.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(listed, want);
    // And libmaru retrieves them, one by one and in a batch.
    let paths: Vec<String> = keys.iter().map(|k| maru::key::path("keys", k)).collect();
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    let batch = h.batch_retrieve(&refs).unwrap();
    for (i, path) in paths.iter().enumerate() {
        let data = pattern(i as u64, 3000 + i * 1000);
        assert_eq!(
            h.retrieve(path).unwrap().unwrap().as_slice(),
            &data[..],
            "{path}"
        );
        assert_eq!(batch[i].as_ref().unwrap().as_slice(), &data[..], "{path}");
    }
    // The other way: written through the mount under the encoded names (a long key's segment
    // namespaces made with mkdir), found by libmaru under the same keys.
    std::fs::create_dir(d.path("back")).unwrap();
    for (i, key) in keys.iter().enumerate() {
        let path = maru::key::path("back", key);
        for ns in maru::key::segment_namespaces(&path) {
            std::fs::create_dir(mnt.join(ns)).unwrap();
        }
        std::fs::write(mnt.join(&path), pattern(100 + i as u64, 5000)).unwrap();
        assert!(h.exists(&path).unwrap(), "{path}");
        assert_eq!(
            h.retrieve(&path).unwrap().unwrap().as_slice(),
            &pattern(100 + i as u64, 5000)[..],
            "{path}"
        );
    }
    let mut listed = Vec::new();
    keys_under(&d.path("back"), "", &mut listed);
    listed.sort();
    assert_eq!(listed, want);
}
