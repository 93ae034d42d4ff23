//! Harness for end-to-end tests: starts the real `marud` on temporary pools,
//! socket and mount, and always cleans up (unmounts, kills) on drop, including
//! on panic.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub mod faults;

/// Path of a workspace binary (built on first use if missing).
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/test-xxxx -> target/<profile>/; a binary of this crate
    // (maru-faults) is in target/<profile>/ itself.
    let parent = exe.parent().expect("target dir");
    let dir = if parent.ends_with("deps") {
        parent.parent().expect("target dir")
    } else {
        parent
    }
    .to_owned();
    let profile_release = dir.ends_with("release");
    let p = dir.join(name);
    BUILT.get_or_init(|| {
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.args(["build", "--quiet", "--bins", "--workspace"]);
        if profile_release {
            c.arg("--release");
        }
        let st = c.status().expect("running cargo build for the binaries");
        assert!(st.success(), "building the workspace binaries failed");
    });
    assert!(p.exists(), "{} was not built", p.display());
    p
}

/// True when this process runs with effective uid 0.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Whether a test that needs root runs here: true as root. Otherwise it prints
/// `skipped: <test> needs root` to stderr and returns false, so `cargo test` works for a
/// contributor without root; with `MARU_REQUIRE_ROOT=1` (CI) it panics instead, so a machine
/// that is supposed to run everything cannot skip anything quietly.
/// Tests call it through [`require_root!`].
pub fn root_or_skip(test: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var_os("MARU_REQUIRE_ROOT").is_some_and(|v| v == "1") {
        panic!("{test} needs root, and MARU_REQUIRE_ROOT=1 says this run has it: run as root");
    }
    eprintln!("skipped: {test} needs root");
    false
}

/// The first statement of a test that needs root (it mounts FUSE or tmpfs, reads
/// `/proc/self/pagemap`, or acts as other users): returns from the test, after saying so on
/// stderr, when the effective uid is not 0, and fails it instead under `MARU_REQUIRE_ROOT=1`.
/// See [`root_or_skip`].
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::root_or_skip({
            fn here() {}
            let name = ::std::any::type_name_of_val(&here);
            name.strip_suffix("::here").unwrap_or(name)
        }) {
            return;
        }
    };
}

/// True if `dir` is a mount point (of any type).
pub fn is_mounted(dir: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = dir.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4) == Some(&want))
}

/// Whether `dir` is a mount point in the mount namespace of process `pid`.
pub fn is_mounted_in(pid: u32, dir: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
        return false;
    };
    let want = dir.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4) == Some(&want))
}

pub use maru_cluster::testing::enter_host;

/// Lazily unmounts `dir` if it is mounted.
pub fn force_unmount(dir: &Path) {
    while is_mounted(dir) {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("no NUL");
        // SAFETY: valid C string.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            break;
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Pool specs relative to the temp dir: `memfs:{dir}/pool,size=64M` ({dir} is replaced).
    pub pools: Vec<String>,
    /// Mount the filesystem.
    pub mount: bool,
    /// Extra flags.
    pub extra: Vec<String>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            pools: vec!["memfs:{dir}/pool,size=256M".into()],
            mount: true,
            extra: Vec::new(),
        }
    }
}

/// A running daemon on temporary paths.
pub struct Daemon {
    child: Option<Child>,
    /// A killed daemon that has not finished exiting (see [`Daemon::kill9`]).
    dying: Option<Child>,
    /// The temp dir holding everything.
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
    /// The control socket.
    pub socket: PathBuf,
    /// The mount point (if mounted).
    pub mount: Option<PathBuf>,
    args: Vec<String>,
    pool_dirs: Vec<PathBuf>,
    /// Daemon log file.
    pub log: PathBuf,
    /// The network namespace it runs in (None: the test's).
    netns: Option<String>,
    /// Environment variables of its own (UCX's device in a namespace, say).
    env: Vec<(String, String)>,
    /// It runs as a host of its network namespace with a mount namespace of its own
    /// ([`enter_host`]): its mount is reached through `/proc/PID/root`.
    own_mounts: bool,
}

impl Opts {
    /// True if marud needs root to start with these options: it mounts the FUSE filesystem
    /// and a tmpfs for each memfs pool. (Only `file:` pools without the mount run unprivileged.)
    pub fn needs_root(&self) -> bool {
        self.mount || self.pools.iter().any(|p| !p.starts_with("file:"))
    }
}

impl Daemon {
    /// Starts a daemon and waits until it serves.
    pub fn start(opts: Opts) -> Self {
        Self::start_in(opts, None)
    }

    /// [`Daemon::start`] in network namespace `netns` (a namespace under /run/netns, as
    /// `ip netns add` makes). Its socket and mount are reachable from the test as usual
    /// (paths are not network-namespaced).
    pub fn start_in(opts: Opts, netns: Option<&str>) -> Self {
        Self::start_in_env(opts, netns, &[])
    }

    /// [`Daemon::start_in`] with environment variables of its own.
    pub fn start_in_env(opts: Opts, netns: Option<&str>, env: &[(&str, &str)]) -> Self {
        Self::start_with(opts, netns, env, false)
    }

    /// A daemon that is a host of network namespace `netns` ([`enter_host`]: a mount
    /// namespace and a /sys of its own), with environment variables of its own. Its mount is
    /// reached at [`Daemon::path`] through `/proc/PID/root`, and goes with its last process.
    pub fn start_host(opts: Opts, netns: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(opts, Some(netns), env, true)
    }

    fn start_with(opts: Opts, netns: Option<&str>, env: &[(&str, &str)], own_mounts: bool) -> Self {
        assert!(
            is_root() || !opts.needs_root(),
            "marud needs root to mount: start the test with maru_tests::require_root!()"
        );
        let tmp = tempfile::Builder::new()
            .prefix("maru-e2e-")
            .tempdir_in("/tmp")
            .expect("temp dir");
        let dir = tmp.path().to_owned();
        let socket = dir.join("marud.sock");
        let mount = opts.mount.then(|| dir.join("mnt"));
        let mut args = Vec::new();
        let mut pool_dirs = Vec::new();
        for p in &opts.pools {
            let spec = p.replace("{dir}", &dir.to_string_lossy());
            if let Some(rest) = spec.strip_prefix("memfs:") {
                pool_dirs.push(PathBuf::from(rest.split(',').next().unwrap_or("")));
            }
            args.push("--pool".into());
            args.push(spec);
        }
        args.extend([
            "--socket".into(),
            socket.to_string_lossy().into_owned(),
            "--state-dir".into(),
            dir.join("state").to_string_lossy().into_owned(),
            "--unmount-pools".into(),
        ]);
        match &mount {
            Some(m) => {
                args.push("--mount".into());
                args.push(m.to_string_lossy().into_owned());
            }
            None => args.push("--no-mount".into()),
        }
        args.extend(opts.extra.iter().cloned());
        let log = dir.join("marud.log");
        let mut d = Daemon {
            child: None,
            dying: None,
            dir,
            _tmp: tmp,
            socket,
            mount,
            args,
            pool_dirs,
            log,
            netns: netns.map(str::to_owned),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            own_mounts,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = Command::new(bin("marud"));
        // The network namespace only (`ip netns exec` would also give it a mount namespace of
        // its own, hiding its mount from the test).
        let netns = self.netns.as_ref().map(|ns| {
            std::fs::File::open(format!("/run/netns/{ns}")).expect("the network namespace")
        });
        let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let own_mounts = self.own_mounts;
        // The daemon's own environment last: it may set MARU_LOG itself.
        cmd.args(&self.args)
            .env(
                "MARU_LOG",
                std::env::var("MARU_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup"))
            .stderr(logf);
        // SAFETY: setsid is async-signal-safe; the daemon gets its own session so a test's
        // terminal signals do not reach it.
        unsafe {
            cmd.pre_exec(move || {
                match netns_fd {
                    Some(fd) if own_mounts => enter_host(fd)?,
                    Some(fd) if libc::setns(fd, libc::CLONE_NEWNET) != 0 => {
                        return Err(std::io::Error::last_os_error());
                    }
                    _ => {}
                }
                libc::setsid();
                // If the test process dies without cleaning up, the daemon stops (and
                // unmounts) too.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting marud");
        self.child = Some(child);
        // A predecessor stuck in its exit still accepts connections on the socket and holds
        // the mount: the new daemon is ready only once it is gone.
        if let Some(mut c) = self.dying.take() {
            let pid = c.id();
            if !exits_within(&mut c, Duration::from_secs(15)) {
                self.dying = Some(c);
                panic!(
                    "marud {pid}, killed, still had not exited 15 s after its successor started:\n{}",
                    self.log_text()
                );
            }
        }
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let t = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                panic!("marud exited early ({st}):\n{}", self.log_text());
            }
            let sock_ok = std::os::unix::net::UnixStream::connect(&self.socket).is_ok();
            let mnt_ok = self.mount.as_ref().is_none_or(|m| match &self.child {
                Some(c) if self.own_mounts => is_mounted_in(c.id(), m),
                _ => is_mounted(m),
            });
            if sock_ok && mnt_ok {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "marud did not become ready:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Kills the daemon with SIGKILL (its pools and a dead mount stay behind, like a crash).
    /// A daemon that has not exited 5 s later is stuck in its exit (a thread of it waits in
    /// the kernel on a lock held by a request to its own mount): the next start must end it
    /// (marud's `end_predecessor`), and [`Daemon::restart`] checks that it did.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            if !exits_within(&mut c, Duration::from_secs(5)) {
                self.dying = Some(c);
            }
        }
    }

    /// The pid of a killed daemon still exiting after [`Daemon::kill9`]'s wait.
    pub fn dying(&self) -> Option<u32> {
        self.dying.as_ref().map(Child::id)
    }

    /// Stops the daemon with SIGTERM and waits.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            if exits_within(&mut c, Duration::from_secs(10)) {
                return;
            }
            self.child = Some(c);
            self.kill9();
        }
    }

    /// Starts the daemon again with the same arguments (after `kill9` or `stop`).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop it first");
        self.spawn();
    }

    /// Starts the daemon again with its arguments changed by `edit` (after `kill9` or `stop`).
    pub fn restart_with(&mut self, edit: impl FnOnce(&mut Vec<String>)) {
        edit(&mut self.args);
        self.restart();
    }

    /// A client connected to this daemon.
    pub fn handler(&self) -> maru::Handler {
        maru::Handler::connect(self.client_config()).expect("connecting to marud")
    }

    /// A client configuration for this daemon.
    pub fn client_config(&self) -> maru::Config {
        maru::Config {
            socket: self.socket.clone(),
            ..Default::default()
        }
    }

    /// Path under the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        let m = self.mount.as_ref().expect("mounted").join(rel);
        match &self.child {
            Some(c) if self.own_mounts => {
                PathBuf::from(format!("/proc/{}/root{}", c.id(), m.display()))
            }
            _ => m,
        }
    }

    /// Path under the mount while the daemon runs with its mount up (None otherwise: a
    /// path then could reach the directory under the mount, or nothing).
    pub fn mounted_path(&self, rel: &str) -> Option<PathBuf> {
        let (c, m) = (self.child.as_ref()?, self.mount.as_ref()?);
        let up = if self.own_mounts {
            is_mounted_in(c.id(), m)
        } else {
            is_mounted(m)
        };
        up.then(|| self.path(rel))
    }

    /// The first memfs pool's directory.
    pub fn pool_dir(&self) -> &Path {
        &self.pool_dirs[0]
    }

    /// Waits until the entry written through the mount at `rel` is published, and returns its
    /// path under the mount. Publication follows the kernel's release of the writer's last
    /// handle, which comes asynchronously after its `close`; over io_uring the RELEASE may
    /// even be served after requests sent later from another CPU. Processes that look the
    /// name up through the mount wait for it themselves; a test that looks at the pool's
    /// files, or at the entry's state, waits here first.
    pub fn published(&self, rel: &str) -> PathBuf {
        let p = self.path(rel);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match xattr(&p, "user.maru.state") {
                Ok(s) if s == b"sealed" => return p,
                r if Instant::now() > deadline => panic!("{rel} not published in 10 s: {r:?}"),
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
}

/// Extended attribute `name` of `p`.
pub fn xattr(p: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())?;
    let n = std::ffi::CString::new(name)?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid C strings, and a buffer of `buf.len()` bytes.
    let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// Sets extended attribute `name` of `p` to `v`.
pub fn set_xattr(p: &Path, name: &str, v: &[u8]) -> std::io::Result<()> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())?;
    let n = std::ffi::CString::new(name)?;
    // SAFETY: valid C strings, and a buffer of `v.len()` bytes.
    let r = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("MARU_TEST_SHOWLOG").is_some() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- marud log (last lines) ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        let t = Instant::now();
        self.stop();
        if self.dying.is_some() {
            // Only a successor ends a daemon stuck in its exit: start one, and stop it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.spawn()));
            self.stop();
        }
        // Kept for a post-mortem (the faults harness's runs, by hand).
        if let Some(keep) = std::env::var_os("MARU_TEST_KEEP_LOGS") {
            let name = self.dir.file_name().unwrap_or_default().to_string_lossy();
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::copy(&self.log, PathBuf::from(keep).join(format!("{name}.log")));
        }
        if std::env::var_os("MARU_TEST_SHOWLOG").is_some() {
            eprintln!("stop took {:?}", t.elapsed());
        }
        if self.own_mounts {
            return; // its mounts went with its mount namespace
        }
        if let Some(m) = &self.mount {
            force_unmount(m);
        }
        for p in &self.pool_dirs {
            force_unmount(p);
        }
    }
}

/// Whether child `c` exits (and is reaped) within `limit`.
fn exits_within(c: &mut Child, limit: Duration) -> bool {
    let t = Instant::now();
    loop {
        if !matches!(c.try_wait(), Ok(None)) {
            return true;
        }
        if t.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Physical frame numbers of the pages of `[ptr, ptr+len)` in this process (needs root).
pub fn pfns(ptr: *const u8, len: usize) -> Vec<u64> {
    use std::os::unix::fs::FileExt;
    let page = 4096usize;
    let f = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
    let start = ptr as usize / page;
    let end = (ptr as usize + len).div_ceil(page);
    let mut out = Vec::new();
    for vp in start..end {
        // Touch the page so it is present.
        // SAFETY: inside the caller's mapping.
        unsafe { std::ptr::read_volatile((vp * page).max(ptr as usize) as *const u8) };
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, (vp * 8) as u64)
            .expect("pagemap read");
        let e = u64::from_le_bytes(b);
        assert!(e & (1 << 63) != 0, "page not present");
        out.push(e & ((1 << 55) - 1));
    }
    out
}

/// A child process killed and reaped when dropped, so that a failing test leaves none behind.
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What the store counted of reads so far: `retrieve` requests, `accessed` reports (of entries
/// clients opened themselves) and bytes retrieved; printed `retrieve=R accessed=A bytes=B` (so a
/// probe process can report it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadCounts {
    /// `retrieve` requests.
    pub retrieve: u64,
    /// `accessed` reports.
    pub accessed: u64,
    /// Bytes retrieved.
    pub bytes: u64,
}

impl ReadCounts {
    /// The store's counts now, asked through `h` (the request carries `h`'s own report first).
    pub fn of(h: &maru::Handler) -> maru::Result<Self> {
        let s = h.stats()?;
        let op = |n: &str| s.ops.get(n).copied().unwrap_or(0);
        Ok(ReadCounts {
            retrieve: op("retrieve"),
            accessed: op("accessed"),
            bytes: s.bytes.get("retrieved").copied().unwrap_or(0),
        })
    }
}

impl std::fmt::Display for ReadCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "retrieve={} accessed={} bytes={}",
            self.retrieve, self.accessed, self.bytes
        )
    }
}

/// Deterministic test bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Runs `maru-probe` with arguments; returns stdout (panics on failure).
pub fn probe(args: &[&str]) -> String {
    let out = Command::new(bin("maru-probe"))
        .args(args)
        .output()
        .expect("running maru-probe");
    assert!(
        out.status.success(),
        "maru-probe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}
