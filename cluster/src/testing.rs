//! Test support: a private etcd (Debian's `etcd-server`), and network namespaces standing in
//! for hosts. Everything is torn down when its guard drops, panics included: etcd is killed
//! by pid, the namespaces (and the links in them) are deleted.
//!
//! Without an `etcd` binary, or without root for namespaces, [`Etcd::start`] and [`Net::new`]
//! return `None` (the test skips), unless `MARU_REQUIRE_ROOT` is set (CI), where they panic.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn required() -> bool {
    std::env::var_os("MARU_REQUIRE_ROOT").is_some()
}

fn skip(why: &str) {
    assert!(!required(), "{why}");
    eprintln!("skipped: {why}");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A private etcd with its data in a temporary directory.
pub struct Etcd {
    child: Option<Child>,
    endpoint: String,
    dir: tempfile::TempDir,
    netns: Option<String>,
    ip: String,
    ports: (u16, u16),
}

impl Etcd {
    /// On loopback, on free ports; None (skip) when etcd is not installed outside CI.
    pub fn start() -> Option<Etcd> {
        Self::start_at(None, "127.0.0.1", free_port(), free_port())
    }

    /// In network namespace `netns` (None: this one), listening on `ip`.
    pub fn start_at(netns: Option<&str>, ip: &str, client: u16, peer: u16) -> Option<Etcd> {
        if Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            skip("etcd is not installed (apt-get install etcd-server)");
            return None;
        }
        // Its data in memory where there is a tmpfs: etcd syncs every write, and on a disk
        // busy with a build's output one sync can take seconds.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::Builder::new()
                .prefix("maru-etcd-")
                .tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .expect("tempdir");
        let mut etcd = Etcd {
            child: None,
            endpoint: format!("http://{ip}:{client}"),
            dir,
            netns: netns.map(str::to_owned),
            ip: ip.to_owned(),
            ports: (client, peer),
        };
        etcd.spawn();
        Some(etcd)
    }

    fn spawn(&mut self) {
        let peer_url = format!("http://{}:{}", self.ip, self.ports.1);
        // `ip netns exec` enters the namespace and execs etcd: the child's pid is etcd's.
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.path())
            .args(["--listen-client-urls", &self.endpoint])
            .args(["--advertise-client-urls", &self.endpoint])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_ready(self.netns.as_deref(), &self.ip, self.ports.0);
    }

    /// Kills etcd (SIGKILL: as a crash); its data stays for [`Etcd::restart`].
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same data and ports.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Waits until etcd reports itself healthy (it has a leader), on its `/health` page.
    fn wait_ready(&self, netns: Option<&str>, ip: &str, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("{ip}:{port}");
        let healthy = || {
            use std::io::{Read, Write};
            let Ok(mut c) = std::net::TcpStream::connect(&addr) else {
                return false;
            };
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let mut body = String::new();
            c.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
                && c.read_to_string(&mut body).is_ok()
                && body.contains("\"health\":\"true\"")
        };
        loop {
            let up = match netns {
                None => healthy(),
                Some(ns) => in_netns(ns, healthy),
            };
            if up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd was not healthy on {addr} in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Makes the calling process a host of network namespace `netns_fd`, as `ip netns exec`
/// does: it joins the namespace, takes a mount namespace of its own whose mounts do not
/// propagate back, and mounts a sysfs of the namespace's own on /sys (so that programs that
/// list network devices in /sys, UCX among them, see the namespace's). For `pre_exec`: system
/// calls only.
pub fn enter_host(netns_fd: std::os::fd::RawFd) -> std::io::Result<()> {
    // SAFETY: plain system calls with static C strings.
    unsafe {
        if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 || libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let none = std::ptr::null();
        if libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_SLAVE,
            none.cast(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        libc::umount2(c"/sys".as_ptr(), libc::MNT_DETACH);
        if libc::mount(
            c"sysfs".as_ptr(),
            c"/sys".as_ptr(),
            c"sysfs".as_ptr(),
            0,
            none.cast(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs `f` on a thread of its own that entered network namespace `ns`.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns);
            f()
        })
        .join()
        .expect("the namespace thread panicked")
    })
}

fn enter(ns: &str) {
    let f = std::fs::File::open(format!("/run/netns/{ns}")).expect("open the netns");
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

static NETS: AtomicU32 = AtomicU32::new(0);

/// Hosts as network namespaces: a hub namespace holds a bridge (and etcd, at
/// [`Net::hub_ip`]); each host namespace is joined to it by a veth pair, with an address in
/// a private /24 chosen per test run.
pub struct Net {
    pub hub: String,
    pub hosts: Vec<String>,
    prefix: String,
    subnet: String,
}

impl Net {
    /// `n` hosts; None (skip) without root or `ip` outside CI.
    pub fn new(n: usize) -> Option<Net> {
        if !nix::unistd::geteuid().is_root() || Command::new("ip").arg("-V").output().is_err() {
            skip("network namespaces need root and iproute2");
            return None;
        }
        let k = NETS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let prefix = format!("mc{}{k}", pid % 100_000);
        let subnet = format!("10.{}.{}", 200 + (pid % 50), (pid / 50 + k * 7) % 250);
        let mut net = Net {
            hub: format!("{prefix}hub"),
            hosts: Vec::new(),
            prefix,
            subnet,
        };
        ip(&["netns", "add", &net.hub]);
        ip(&["-n", &net.hub, "link", "set", "lo", "up"]);
        ip(&["-n", &net.hub, "link", "add", "br0", "type", "bridge"]);
        let hub_addr = format!("{}/24", net.hub_ip());
        ip(&["-n", &net.hub, "addr", "add", &hub_addr, "dev", "br0"]);
        ip(&["-n", &net.hub, "link", "set", "br0", "up"]);
        for i in 0..n {
            let host = format!("{}h{i}", net.prefix);
            ip(&["netns", "add", &host]);
            net.hosts.push(host.clone());
            let (inner, outer) = (format!("{}v{i}", net.prefix), format!("{}p{i}", net.prefix));
            ip(&[
                "link", "add", &inner, "netns", &host, "type", "veth", "peer", "name", &outer,
                "netns", &net.hub,
            ]);
            ip(&["-n", &host, "link", "set", "lo", "up"]);
            let addr = format!("{}.{}/24", net.subnet, i + 2);
            ip(&["-n", &host, "addr", "add", &addr, "dev", &inner]);
            ip(&["-n", &host, "link", "set", &inner, "up"]);
            ip(&["-n", &net.hub, "link", "set", &outer, "master", "br0"]);
            ip(&["-n", &net.hub, "link", "set", &outer, "up"]);
        }
        Some(net)
    }

    /// The hub's address on the bridge (where etcd listens).
    pub fn hub_ip(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// Host `i`'s address.
    pub fn host_ip(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 2)
    }

    /// Host `i`'s network device (its end of the veth pair).
    pub fn host_dev(&self, i: usize) -> String {
        format!("{}v{i}", self.prefix)
    }

    /// The file naming host `i`'s network namespace (for `setns`).
    pub fn host_path(&self, i: usize) -> std::path::PathBuf {
        format!("/run/netns/{}", self.hosts[i]).into()
    }

    /// Takes host `i`'s link down (cut off) or up again.
    pub fn link(&self, i: usize, up: bool) {
        let outer = format!("{}p{i}", self.prefix);
        ip(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &outer,
            if up { "up" } else { "down" },
        ]);
    }

    /// A tokio runtime whose threads live in host `i`'s namespace: futures spawned on it
    /// open their sockets there.
    pub fn runtime(&self, i: usize) -> tokio::runtime::Runtime {
        let ns = self.hosts[i].clone();
        in_netns(&ns, || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .max_blocking_threads(2)
                .enable_all()
                .build()
                .expect("runtime")
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(std::iter::once(&self.hub)) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
