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

    /// Stops etcd (SIGSTOP: it answers nothing, connections stay open) or lets it go on
    /// (SIGCONT).
    pub fn pause(&self, paused: bool) {
        if let Some(c) = &self.child {
            let sig = if paused { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: a signal to the child this value started and still owns.
            unsafe { libc::kill(c.id() as i32, sig) };
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

/// A three-member (or `n`-member) etcd: members `m0`, `m1`, ... all listening on `ip` in
/// network namespace `netns` (None: this one), each on ports of its own, each with its data
/// in a temporary directory, its log beside it ([`EtcdCluster::log`]). A member can be killed
/// (SIGKILL, as a crash) and restarted on its data; every member is killed by pid when the
/// cluster drops.
pub struct EtcdCluster {
    members: Vec<Member>,
    /// Where the harness's own requests ([`EtcdCluster::http`]) come from.
    from: Option<String>,
}

struct Member {
    child: Option<Child>,
    dir: tempfile::TempDir,
    at: Place,
    client: u16,
    peer: u16,
}

/// Where an etcd member runs: a network namespace (None: this one) and its address there.
#[derive(Debug, Clone)]
pub struct Place {
    pub netns: Option<String>,
    pub ip: String,
}

impl EtcdCluster {
    /// A member at each of `places`, on ports from `base` (client `base + 100 i`, peer one
    /// above), asked by the harness from namespace `from`; None (skip) when etcd is not
    /// installed outside CI.
    pub fn start(from: Option<&str>, places: &[Place], base: u16) -> Option<EtcdCluster> {
        if Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            skip("etcd is not installed (apt-get install etcd-server)");
            return None;
        }
        let members = places
            .iter()
            .enumerate()
            .map(|(i, at)| Member {
                child: None,
                dir: data_dir(),
                at: at.clone(),
                client: base + 100 * i as u16,
                peer: base + 100 * i as u16 + 1,
            })
            .collect();
        let mut c = EtcdCluster {
            members,
            from: from.map(str::to_owned),
        };
        let n = places.len();
        for i in 0..n {
            c.spawn(i);
        }
        for i in 0..n {
            c.wait_ready(i);
        }
        Some(c)
    }

    fn spawn(&mut self, i: usize) {
        let cluster: Vec<String> = self
            .members
            .iter()
            .enumerate()
            .map(|(k, m)| format!("m{k}=http://{}:{}", m.at.ip, m.peer))
            .collect();
        let m = &self.members[i];
        // Appended to across restarts: one member's whole life in one file.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(i))
            .expect("etcd member's log");
        let client = format!("http://{}:{}", m.at.ip, m.client);
        let peer = format!("http://{}:{}", m.at.ip, m.peer);
        let mut cmd = match &m.at.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = cmd
            .args(["--name", &format!("m{i}"), "--data-dir"])
            .arg(m.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &cluster.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "maru-faults"])
            // As etcd 3.5 and later run by default: a member back from a partition of its own
            // asks before it stands for election, and does not depose a leader the others
            // follow (3.4's default: an election, and no leader for seconds, at every return).
            .arg("--pre-vote")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.members[i].child = Some(child);
    }

    fn wait_ready(&self, i: usize) {
        let port = self.members[i].client;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.healthy(i) {
            assert!(
                Instant::now() < deadline,
                "etcd member m{i} was not healthy on port {port} in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether member `i` answers that the cluster has a leader.
    pub fn healthy(&self, i: usize) -> bool {
        let body = self.http(i, "GET", "/health", "");
        body.is_some_and(|b| b.contains("\"health\":\"true\""))
    }

    /// A request to member `i`'s client port (JSON gateway); the response, headers included.
    pub fn http(&self, i: usize, method: &str, path: &str, body: &str) -> Option<String> {
        let m = &self.members[i];
        let addr = format!("{}:{}", m.at.ip, m.client);
        let req = format!(
            "{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let go = move || {
            use std::io::{Read, Write};
            let mut c =
                std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(1))
                    .ok()?;
            c.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
            c.write_all(req.as_bytes()).ok()?;
            let mut out = String::new();
            c.read_to_string(&mut out).ok()?;
            Some(out)
        };
        match &self.from {
            None => go(),
            Some(ns) => in_netns(ns, go),
        }
    }

    /// Compacts the keyspace at its current revision (asked of any member that answers);
    /// the revision compacted, if one did.
    pub fn compact(&self) -> Option<i64> {
        for i in 0..self.members.len() {
            let Some(r) = self.http(i, "POST", "/v3/kv/range", r#"{"key":"AA=="}"#) else {
                continue;
            };
            let Some(rev) = r
                .split("\"revision\":\"")
                .nth(1)
                .and_then(|t| t.split('"').next())
                .and_then(|t| t.parse::<i64>().ok())
            else {
                continue;
            };
            let body = format!(r#"{{"revision":"{rev}","physical":true}}"#);
            if self
                .http(i, "POST", "/v3/kv/compaction", &body)
                .is_some_and(|r| r.contains(" 200 "))
            {
                return Some(rev);
            }
        }
        None
    }

    /// Member `i`'s id, the leader it knows (0: none) and its raft term, from its status;
    /// None when it does not answer.
    pub fn leader(&self, i: usize) -> Option<MemberStatus> {
        let reply = self.http(i, "POST", "/v3/maintenance/status", "{}")?;
        let (_, body) = reply.split_once("\r\n\r\n")?;
        let json: serde_json::Value = serde_json::from_str(body).ok()?;
        let id = |v: &serde_json::Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
        Some(MemberStatus {
            id: id(&json["header"]["member_id"])?,
            leader: id(&json["leader"]).unwrap_or(0),
            term: id(&json["raftTerm"]).unwrap_or(0),
        })
    }

    /// The member that leads, by its own status (None when none answers as the leader).
    pub fn leader_member(&self) -> Option<usize> {
        (0..self.len()).find(|&i| {
            self.leader(i)
                .is_some_and(|s| s.leader != 0 && s.id == s.leader)
        })
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Every member's client URL (for `--cluster`).
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://{}:{}", m.at.ip, m.client))
            .collect()
    }

    /// Member `i`'s log (its standard error, every run of it), until the cluster drops.
    pub fn log(&self, i: usize) -> std::path::PathBuf {
        self.members[i].dir.path().join("etcd.log")
    }

    /// Member `i`'s pid, while it runs (`ip netns exec` execs etcd: the child's pid is etcd's).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// `n` members on loopback, on ports free when asked.
    pub fn on_loopback(n: usize) -> Option<EtcdCluster> {
        let places = vec![
            Place {
                netns: None,
                ip: "127.0.0.1".into(),
            };
            n
        ];
        // Ports base + 100 i and one above, each free: the first base found so.
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        let base = (0..200)
            .map(|k| 20_000 + (std::process::id() as u16 % 97 + k) * 211 % 20_000)
            .find(|&b| (0..n as u16).all(|i| free(b + 100 * i) && free(b + 100 * i + 1)))
            .expect("free loopback ports");
        Self::start(None, &places, base)
    }

    /// Stops member `i` (SIGSTOP: its connections stay open, nothing is answered, as with a
    /// member behind a partition until keep-alive gives up), or lets it go on (SIGCONT).
    pub fn pause(&self, i: usize, paused: bool) {
        if let Some(c) = &self.members[i].child {
            let sig = if paused { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: a signal to the child this value started and still owns.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Kills member `i` (SIGKILL); its data stays for [`EtcdCluster::restart`].
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data (it rejoins the others); waits until it is healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        self.wait_ready(i);
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

fn data_dir() -> tempfile::TempDir {
    // In memory where there is a tmpfs: etcd syncs every write, and on a disk busy with a
    // build's output one sync can take seconds.
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::Builder::new()
            .prefix("maru-etcd-")
            .tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .expect("tempdir")
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
/// a private /24 chosen per test run. Etcd members may have namespaces of their own on the
/// bridge too ([`Net::with_members`]), so that they can be cut from each other.
pub struct Net {
    pub hub: String,
    pub hosts: Vec<String>,
    /// Etcd members' namespaces.
    pub members: Vec<String>,
    prefix: String,
    subnet: String,
}

impl Net {
    /// `n` hosts; None (skip) without root or `ip` outside CI.
    pub fn new(n: usize) -> Option<Net> {
        Net::with_members(n, 0)
    }

    /// `n` hosts and `m` namespaces for etcd members ([`Net::member_place`]); None (skip)
    /// without root or `ip` outside CI.
    pub fn with_members(n: usize, m: usize) -> Option<Net> {
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
            members: Vec::new(),
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
            net.attach(&host, &format!("{i}"), &net.host_ip(i));
            net.hosts.push(host);
        }
        for i in 0..m {
            let member = format!("{}e{i}", net.prefix);
            net.attach(&member, &format!("e{i}"), &net.member_ip(i));
            net.members.push(member);
        }
        Some(net)
    }

    /// Makes namespace `ns`, joined to the bridge by a veth pair named after `tag`, with
    /// address `addr`.
    fn attach(&self, ns: &str, tag: &str, addr: &str) {
        ip(&["netns", "add", ns]);
        let (inner, outer) = (
            format!("{}v{tag}", self.prefix),
            format!("{}p{tag}", self.prefix),
        );
        ip(&[
            "link", "add", &inner, "netns", ns, "type", "veth", "peer", "name", &outer, "netns",
            &self.hub,
        ]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            &inner,
        ]);
        ip(&["-n", ns, "link", "set", &inner, "up"]);
        ip(&["-n", &self.hub, "link", "set", &outer, "master", "br0"]);
        ip(&["-n", &self.hub, "link", "set", &outer, "up"]);
    }

    /// Etcd member `i`'s address.
    pub fn member_ip(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, 100 + i)
    }

    /// Where etcd member `i` runs: its namespace and address.
    pub fn member_place(&self, i: usize) -> Place {
        Place {
            netns: Some(self.members[i].clone()),
            ip: self.member_ip(i),
        }
    }

    /// Cuts namespace `ns` off address `addr` (a route that discards what it sends there),
    /// or, `cut` false, joins them again. One way: cut both ends for a partition.
    pub fn block(&self, ns: &str, addr: &str, cut: bool) {
        let dst = format!("{addr}/32");
        ip(&[
            "-n",
            ns,
            "route",
            if cut { "add" } else { "del" },
            "blackhole",
            &dst,
        ]);
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
        for ns in self
            .hosts
            .iter()
            .chain(&self.members)
            .chain(std::iter::once(&self.hub))
        {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// What a member of an [`EtcdCluster`] says of itself ([`EtcdCluster::leader`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberStatus {
    pub id: u64,
    /// The leader it follows (or is), 0 for none.
    pub leader: u64,
    /// Its raft term: each election, even one the same member wins again, begins a new one
    /// (and a new leader renews every lease).
    pub term: u64,
}
