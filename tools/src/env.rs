//! A private marud for benchmarks: temporary pools, socket and mount, cleaned up on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A daemon started by the harness.
pub struct PrivateDaemon {
    child: Option<Child>,
    /// Control socket.
    pub socket: PathBuf,
    /// Mount point, if mounted.
    pub mount: Option<PathBuf>,
    /// Memfs pool directories.
    pub pool_dirs: Vec<PathBuf>,
}

/// Path of a sibling binary (marud next to maructl).
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("exe dir")?.join(name);
    if p.exists() {
        return Ok(p);
    }
    // Installed layout: /usr/sbin/marud, /usr/bin/maructl.
    for d in ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"] {
        let p = Path::new(d).join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    bail!("cannot find {name} next to {}", exe.display())
}

fn mounted(dir: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|s| {
            let want = dir.to_string_lossy();
            s.lines().any(|l| l.split(' ').nth(4) == Some(&want))
        })
        .unwrap_or(false)
}

/// Detaches every mount stacked on `dir`; one that cannot be detached is reported and left.
fn detach(dir: &Path) {
    while mounted(dir) {
        if let Err(e) = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("cannot unmount {}: {e}", dir.display());
            break;
        }
    }
}

impl PrivateDaemon {
    /// Starts marud under `dir` with `pools` (`{dir}` is replaced) and an optional mount.
    pub fn start(dir: &Path, name: &str, pools: &[&str], mount: bool) -> anyhow::Result<Self> {
        Self::start_with(dir, name, pools, mount, &[])
    }

    /// [`PrivateDaemon::start`] with extra marud flags.
    pub fn start_with(
        dir: &Path,
        name: &str,
        pools: &[&str],
        mount: bool,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_exe(&sibling("marud")?, dir, name, pools, mount, extra)
    }

    /// [`PrivateDaemon::start_with`] with the marud at `exe` (another build's, to compare).
    pub fn start_exe(
        exe: &Path,
        dir: &Path,
        name: &str,
        pools: &[&str],
        mount: bool,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let base = dir.join(name);
        std::fs::create_dir_all(&base)?;
        let socket = base.join("marud.sock");
        let mnt = mount.then(|| base.join("mnt"));
        let mut cmd = Command::new(exe);
        let mut pool_dirs = Vec::new();
        for p in pools {
            let spec = p.replace("{dir}", &base.to_string_lossy());
            if let Some(r) = spec.strip_prefix("memfs:") {
                pool_dirs.push(PathBuf::from(r.split(',').next().unwrap_or("")));
            }
            cmd.arg("--pool").arg(spec);
        }
        cmd.arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(base.join("state"))
            .arg("--unmount-pools");
        match &mnt {
            Some(m) => cmd.arg("--mount").arg(m),
            None => cmd.arg("--no-mount"),
        };
        cmd.args(extra);
        let log = std::fs::File::create(base.join("marud.log"))?;
        cmd.env("MARU_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd.spawn().context("starting marud")?;
        let mut d = PrivateDaemon {
            child: Some(child),
            socket,
            mount: mnt,
            pool_dirs,
        };
        let t = Instant::now();
        loop {
            let ok = std::os::unix::net::UnixStream::connect(&d.socket).is_ok()
                && d.mount.as_ref().is_none_or(|m| mounted(m));
            if ok {
                return Ok(d);
            }
            if let Some(c) = d.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                bail!(
                    "marud exited ({st}): {}",
                    std::fs::read_to_string(base.join("marud.log")).unwrap_or_default()
                );
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("marud did not start");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A client of this daemon that stores mostly in namespace `ns`.
    pub fn handler(&self, ns: &str) -> anyhow::Result<maru::Handler> {
        Ok(maru::Handler::connect(self.config(ns))?)
    }

    /// The configuration of [`PrivateDaemon::handler`].
    pub fn config(&self, ns: &str) -> maru::Config {
        maru::Config {
            socket: self.socket.clone(),
            namespace: Some(ns.to_owned()),
            ..Default::default()
        }
    }
}

/// Stops a child of ours: SIGTERM, up to `grace` to exit, then SIGKILL; always reaped.
pub fn stop_child(c: &mut Child, grace: Duration) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    if let Ok(None) = c.try_wait() {
        let pid = i32::try_from(c.id()).map(Pid::from_raw);
        // Not yet reaped, so the pid is still our child's. If SIGTERM cannot be sent,
        // SIGKILL follows at once.
        if let Ok(pid) = pid
            && kill(pid, Signal::SIGTERM).is_ok()
        {
            let t = Instant::now();
            while t.elapsed() < grace {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // Fails only if the child has exited meanwhile: the wait below reaps it.
        let _ = c.kill();
    }
    // Fails only if it was reaped already.
    let _ = c.wait();
}

impl Drop for PrivateDaemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, Duration::from_secs(10));
        }
        if let Some(m) = &self.mount {
            detach(m);
        }
        for p in &self.pool_dirs {
            detach(p);
        }
    }
}

/// A tmpfs mounted by the harness (for direct-mapping baselines); unmounted on drop.
pub struct Tmpfs {
    /// Mount point.
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs with `huge=within_size` (the pool's page policy) at `dir`.
    pub fn mount(dir: &Path, size: u64) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},huge=within_size"))
            .arg("maru-bench")
            .arg(dir)
            .status()?;
        if !st.success() {
            bail!("mounting a tmpfs on {} failed", dir.display());
        }
        Ok(Tmpfs {
            dir: dir.to_owned(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        detach(&self.dir);
    }
}
