//! The remote tier end to end, with real NIXL over UCX/TCP: a memory node and two GPU nodes as
//! network namespaces joined by veth pairs (maru_cluster::testing::Net), marud with
//! `--remote-bind` in the memory node's namespace, workers (`maru-remote-worker`, a process of
//! their own) and `maructl --remote` in the others. UCX is told its device in each namespace
//! (`UCX_NET_DEVICES`) and TCP (`UCX_TLS=tcp`: with the default it would find one kernel and
//! use shared memory).
//!
//! Skips without root or NIXL, except in CI (`MARU_REQUIRE_ROOT`, `MARU_REQUIRE_NIXL`).

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use maru_cluster::testing::{Net, in_netns};
use maru_tests::{Daemon, Opts, Reaped, bin, pattern};
use serde_json::Value;

const TOKEN: &str = "a-remote-token-of-some-length";
const PORT: u16 = 7860;

/// The NIXL library, or None (skip) where it is not installed.
fn nixl_lib() -> Option<String> {
    match maru_nixl::Nixl::locate() {
        Ok(Some(p)) => Some(p.to_string_lossy().into_owned()),
        Ok(None) => Some("libnixl_capi.so".into()),
        Err(e) if std::env::var_os("MARU_REQUIRE_NIXL").is_none() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("MARU_REQUIRE_NIXL is set and NIXL is missing: {e}"),
    }
}

/// A memory node (host 0) serving its pool, and two GPU nodes (hosts 1 and 2).
struct Site {
    net: Net,
    marud: Daemon,
    url: String,
    nixl: String,
    _tokens: tempfile::TempDir,
}

fn ucx_env(net: &Net, host: usize, nixl: &str) -> Vec<(String, String)> {
    vec![
        ("MARU_NIXL_LIB".into(), nixl.into()),
        ("UCX_TLS".into(), "tcp".into()),
        ("UCX_NET_DEVICES".into(), net.host_dev(host)),
        ("UCX_MODULES".into(), "^ib".into()),
    ]
}

impl Site {
    fn new(extra: &[&str]) -> Option<Site> {
        if !maru_tests::root_or_skip("remote") {
            return None;
        }
        let nixl = nixl_lib()?;
        let net = Net::new(3)?;
        let tokens = tempfile::tempdir().expect("temp dir");
        let file = tokens.path().join("tokens");
        std::fs::write(&file, format!("# workers\n{TOKEN} 0:0 gpu\n")).expect("token file");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let url = format!("{}:{PORT}", net.host_ip(0));
        let mut args: Vec<String> = vec![
            "--remote-bind".into(),
            url.clone(),
            "--remote-tokens".into(),
            file.to_string_lossy().into_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = ucx_env(&net, 0, &nixl);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let marud = Daemon::start_host(
            Opts {
                pools: vec!["file:{dir}/pool.img,size=256M".into()],
                mount: true,
                extra: args,
            },
            &net.hosts[0],
            &env,
        );
        let site = Site {
            net,
            marud,
            url,
            nixl,
            _tokens: tokens,
        };
        site.wait_door();
        Some(site)
    }

    /// Waits until the door accepts connections (it opens just after the socket).
    fn wait_door(&self) {
        let t = Instant::now();
        let url = self.url.clone();
        while !in_netns(&self.net.hosts[1], || {
            std::net::TcpStream::connect(&url).is_ok()
        }) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the remote door did not open:\n{}",
                self.marud.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A worker process on GPU node `host`.
    fn worker(&self, host: usize, token: &str, args: &[&str]) -> Command {
        let mut cmd = self.on_node(host, "maru-remote-worker");
        cmd.args(args)
            .env("MARU_REMOTE_TOKEN", token)
            .env("MARU_REMOTE_NODE", format!("gpu{host}"));
        cmd
    }

    /// `maructl --remote` on GPU node `host`, with `args` after the door's URL (the token in
    /// the environment unless `args` name a file).
    fn maructl(&self, host: usize, args: &[&str]) -> std::process::Output {
        let mut cmd = self.on_node(host, "maructl");
        cmd.arg("--remote")
            .arg(format!("tcp://{}", self.url))
            .args(args)
            .env("MARU_REMOTE_TOKEN", TOKEN)
            .output()
            .expect("running maructl")
    }

    /// Program `name` as a process of GPU node `host` (its network namespace and /sys, UCX's
    /// environment for it).
    fn on_node(&self, host: usize, name: &str) -> Command {
        let mut cmd = Command::new(bin(name));
        cmd.envs(ucx_env(&self.net, host, &self.nixl))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        let ns = std::fs::File::open(self.net.host_path(host)).expect("the namespace");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
        // SAFETY: enter_host and prctl make system calls only; the file stays open (moved
        // into the closure) until exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                let _keep = &ns;
                maru_tests::enter_host(fd)?;
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd
    }

    /// Runs a worker to its end; its JSON lines.
    fn run(&self, host: usize, args: &[&str]) -> Vec<Value> {
        let out = self
            .worker(host, TOKEN, args)
            .output()
            .expect("running the worker");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "worker {args:?} failed ({}): {text}\nmarud:\n{}",
            out.status,
            self.marud.log_text()
        );
        text.lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }

    /// A `hold` worker on `host`, once it holds (a reservation, and `ns/key` protected): the
    /// process and the line it printed.
    fn holder(&self, host: usize, ns: &str, key: &str) -> (Reaped, String) {
        let mut w = Reaped(
            self.worker(host, TOKEN, &["hold", &self.url, ns, key])
                .stdout(Stdio::piped())
                .spawn()
                .expect("holder"),
        );
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(w.0.stdout.as_mut().expect("stdout")),
            &mut line,
        )
        .expect("read");
        (w, line)
    }

    fn one(&self, host: usize, args: &[&str]) -> Value {
        self.run(host, args).pop().expect("an answer")
    }

    /// The memory node's local client.
    fn local(&self) -> maru::Handler {
        self.marud.handler()
    }
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn stored_on_one_gpu_node_loaded_on_another_listed_on_the_memory_node() {
    let Some(s) = Site::new(&[]) else { return };
    let url = s.url.as_str();
    // Node 1 stores 1 MiB; node 2 loads it, byte for byte.
    let r = s.one(1, &["store", url, "llama", "k1", "1048576", "11"]);
    assert_eq!(r["stored"], "created", "{r}");
    let want = pattern(11, 1 << 20);
    let got = s.one(2, &["get", url, "llama", "k1"]);
    assert_eq!(got["len"], 1 << 20, "{got}");
    assert_eq!(got["sum"], checksum(&want), "{got}");
    // The memory node sees an entry like any other: under the mount and through libmaru.
    let path = s.marud.published("llama/k1");
    assert_eq!(std::fs::read(&path).expect("read under the mount"), want);
    let m = s
        .local()
        .retrieve("llama/k1")
        .expect("retrieve")
        .expect("found");
    assert_eq!(m.as_slice(), &want[..]);
    // What a local client stores in the pool, a remote worker loads.
    let h = s.local();
    let value = pattern(5, 300_000);
    let mut a = h.alloc(value.len() as u64).expect("alloc");
    a.as_mut_slice().copy_from_slice(&value);
    h.store("llama/local", a).expect("store");
    let got = s.one(2, &["get", url, "llama", "local"]);
    assert_eq!(got["sum"], checksum(&value), "{got}");
    // Write-once across doors: the same name again, from the other node.
    let r = s.one(2, &["store", url, "llama", "k1", "4096", "99"]);
    assert_eq!(r["stored"], "already_present", "{r}");
    assert_eq!(std::fs::read(&path).expect("read"), want);
    // A batch: one exchange and one transfer list each way.
    let b = s.one(1, &["batch", url, "llama", "b", "64", "4096", "7"]);
    assert_eq!(b["equal"], true, "{b}");
    assert!(
        b["outcomes"]
            .as_array()
            .expect("outcomes")
            .iter()
            .all(|o| o["stored"] == "created"),
        "{b}"
    );
    // A miss is a miss.
    assert_eq!(s.one(2, &["get", url, "llama", "nothing"])["missing"], true);
}

#[test]
fn of_two_workers_storing_one_name_at_once_exactly_one_wins() {
    let Some(s) = Site::new(&[]) else { return };
    let url = s.url.as_str();
    for round in 0..3 {
        let key = format!("race-{round}");
        let at = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis()
            + 1500)
            .to_string();
        let spawn = |host: usize, seed: &str| {
            Reaped(
                s.worker(
                    host,
                    TOKEN,
                    &["store", url, "race", &key, "65536", seed, &at],
                )
                .stdout(Stdio::piped())
                .spawn()
                .expect("worker"),
            )
        };
        let (a, b) = (spawn(1, "1"), spawn(2, "2"));
        let read = |mut w: Reaped| -> Value {
            let mut out = String::new();
            std::io::Read::read_to_string(w.0.stdout.as_mut().expect("stdout"), &mut out)
                .expect("read");
            serde_json::from_str(out.trim()).expect("JSON")
        };
        let (ra, rb) = (read(a), read(b));
        let won: Vec<&Value> = [&ra, &rb]
            .into_iter()
            .filter(|r| r["stored"] == "created")
            .collect();
        assert_eq!(won.len(), 1, "{ra} {rb}");
        let lost = if ra["stored"] == "created" { &rb } else { &ra };
        assert_eq!(lost["stored"], "already_present", "{ra} {rb}");
        let winner_seed = if ra["stored"] == "created" { 1 } else { 2 };
        let bytes = std::fs::read(s.marud.published(&format!("race/{key}"))).expect("read");
        assert_eq!(bytes, pattern(winner_seed, 65536), "round {round}");
    }
}

/// The memory node's view of remote sessions: bytes reserved and leases held.
fn remote_sessions(s: &Site) -> (u64, u64) {
    let st = s.local().stats().expect("stats");
    st.clients
        .iter()
        .filter(|c| c.name.starts_with("remote:"))
        .fold((0, 0), |(a, l), c| (a + c.allocated, l + c.leases))
}

fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < within, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

#[test]
fn a_worker_killed_or_silent_leaks_no_reservation_and_no_read_protection() {
    // Short TTLs, so that a silent worker's tickets end within the test.
    let Some(s) = Site::new(&[
        "--remote-reserve-ttl",
        "2",
        "--remote-read-ttl",
        "2",
        "--remote-quarantine-ttl",
        "2",
    ]) else {
        return;
    };
    let url = s.url.as_str();
    assert_eq!(
        s.one(1, &["store", url, "kv", "held", "8192", "3"])["stored"],
        "created"
    );
    let before = s.local().pools()[0].writing_bytes;

    // kill -9 of a worker holding a reservation and a read protection: its lease back at
    // once, its reservation after a quarantine (a WRITE into it might still land).
    let (mut w, line) = s.holder(1, "kv", "held");
    assert!(
        line.contains("\"held\":true") && line.contains("\"found\":1"),
        "{line}"
    );
    let (reserved, leases) = remote_sessions(&s);
    assert!(reserved >= 4 << 20 && leases == 1, "{reserved} {leases}");
    w.0.kill().expect("kill -9");
    let _ = w.0.wait();
    wait_until(
        "a dead worker's lease given back",
        Duration::from_secs(2),
        || remote_sessions(&s).1 == 0,
    );
    let took = wait_until(
        "a dead worker's tickets reclaimed",
        Duration::from_secs(6),
        || remote_sessions(&s) == (0, 0),
    );
    eprintln!("a killed worker's tickets were reclaimed after {took:?}");
    assert_eq!(s.local().pools()[0].writing_bytes, before);

    // A worker that keeps its connection but goes silent: its tickets end with their TTL.
    let (w, line) = s.holder(2, "kv", "held");
    assert!(line.contains("\"held\":true"), "{line}");
    let took = wait_until(
        "a silent worker's tickets expired",
        Duration::from_secs(9),
        || remote_sessions(&s) == (0, 0),
    );
    eprintln!("a silent worker's tickets expired after {took:?} (TTL 2 s, then 2 s of quarantine)");
    assert_eq!(s.local().pools()[0].writing_bytes, before);
    // Nothing sealed was lost.
    assert_eq!(
        std::fs::read(s.marud.published("kv/held")).expect("read"),
        pattern(3, 8192)
    );
    drop(w);
}

#[test]
fn bad_workers_get_clear_errors_and_take_nothing() {
    let Some(s) = Site::new(&[]) else { return };
    let url = s.url.as_str();
    // A wrong token: refused, nothing stored.
    let out = s
        .worker(
            1,
            "not-the-token-at-all-xx",
            &["store", url, "x", "k", "10", "1"],
        )
        .output()
        .expect("worker");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("refused"), "{text}");
    assert!(
        s.local()
            .retrieve("x/k")
            .map(|m| m.is_none())
            .unwrap_or(true)
    );

    let raw = |body: &str| s.run(1, &["raw", url, body]);
    // A malformed first message: a protocol error, then the connection ends.
    let r = raw("{\"id\":1,\"generation\":0,\"op\":\"explode\"}");
    assert_eq!(r[0]["outcome"]["err"]["kind"], "protocol", "{r:?}");
    assert_eq!(r[1]["closed_after"], true, "{r:?}");
    // Not a hello first.
    let r = raw("{\"id\":1,\"generation\":0,\"op\":\"ping\"}");
    assert_eq!(r[0]["outcome"]["err"]["kind"], "protocol", "{r:?}");
    // An oversized frame: refused before it is read (the worker sends a length over it).
    let r = s.run(1, &["oversized", url]);
    assert!(r[0].to_string().contains("exceeds"), "{r:?}");
    assert_eq!(r[1]["closed_after"], true, "{r:?}");
    // A publication of a ticket that is not the worker's: rejected, nothing published.
    let r = s.one(1, &["foreign", url, "x", "stolen"]);
    assert!(r["published"][0]["rejected"].is_object(), "{r}");
    assert!(
        s.local()
            .retrieve("x/stolen")
            .map(|m| m.is_none())
            .unwrap_or(true)
    );

    // A reservation beyond the pool: a clear error, nothing reserved.
    // Two pages of 200 MiB in a 256 MiB pool: all or nothing, so nothing, whatever eviction
    // could free.
    let mb200 = (200u64 << 20).to_string();
    let r = s.one(1, &["reserve", url, "x", &mb200, &mb200]);
    let e = r["error"].as_str().unwrap_or_default().to_owned();
    assert!(e.starts_with("no_space") && e.contains("pool full"), "{r}");
    // A value larger than the worker's staging buffer: refused by the worker itself.
    let big = s.one(
        1,
        &[
            "store",
            url,
            "x",
            "too-big",
            &(100u64 << 20).to_string(),
            "1",
        ],
    );
    assert!(big["error"].as_str().is_some(), "{big}");
    // Everything still works for a good worker, and nothing is left reserved.
    assert_eq!(
        s.one(2, &["store", url, "x", "fine", "4096", "1"])["stored"],
        "created"
    );
    assert_eq!(remote_sessions(&s), (0, 0));
}

#[test]
fn workers_survive_a_memory_node_restart_and_sealed_entries_too() {
    let Some(mut s) = Site::new(&[]) else { return };
    let url = s.url.clone();
    assert_eq!(
        s.one(1, &["store", &url, "kv", "before", "65536", "8"])["stored"],
        "created"
    );
    // Two workers store and load in a loop while marud is killed and started again.
    let spawn = |host: usize| {
        Reaped(
            s.worker(host, TOKEN, &["loop", &url, "kv", "12"])
                .stdout(Stdio::piped())
                .spawn()
                .expect("worker"),
        )
    };
    let (a, b) = (spawn(1), spawn(2));
    std::thread::sleep(Duration::from_secs(3));
    s.marud.kill9();
    std::thread::sleep(Duration::from_millis(500));
    s.marud.restart();
    s.wait_door();
    for mut w in [a, b] {
        let mut out = String::new();
        std::io::Read::read_to_string(w.0.stdout.as_mut().expect("stdout"), &mut out)
            .expect("read");
        let r: Value = serde_json::from_str(out.trim()).expect("JSON");
        eprintln!("worker across the restart: {r}");
        assert!(r["ok"].as_u64().unwrap_or(0) > 10, "{r}");
        assert_eq!(r["last_ok"], true, "{r}");
        // Nothing hung past its timeouts (control 2 s, transfer 3 s).
        assert!(r["longest_ms"].as_u64().unwrap_or(u64::MAX) < 8000, "{r}");
        assert!(r["reconnects"].as_u64().unwrap_or(0) >= 1, "{r}");
    }
    // The entry sealed before the crash is intact.
    let got = s.one(2, &["get", &url, "kv", "before"]);
    assert_eq!(got["sum"], checksum(&pattern(8, 65536)), "{got}");
}

/// `maructl --json --remote URL ARGS` on GPU node `host`: its document (it must succeed).
fn ctl_json(s: &Site, host: usize, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let o = s.maructl(host, &a);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "maructl --remote {args:?} ({}): {text}{}\nmarud:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr),
        s.marud.log_text()
    );
    serde_json::from_str(&text).expect("one JSON document")
}

/// The memory node's `maructl status --json` (its local socket).
fn status(s: &Site) -> Value {
    let o = Command::new(bin("maructl"))
        .arg("--socket")
        .arg(&s.marud.socket)
        .args(["--json", "status"])
        .output()
        .expect("maructl status");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("JSON")
}

/// The remote door's connected workers in `status`.
fn door_workers(st: &Value) -> Vec<Value> {
    st["remote"]["workers"]
        .as_array()
        .expect("the door's workers")
        .clone()
}

/// marud's metrics, fetched inside the memory node's namespace: `name{labels}` -> value.
fn metrics(s: &Site, addr: &str) -> std::collections::BTreeMap<String, f64> {
    let text = in_netns(&s.net.hosts[0], || {
        let mut c = std::net::TcpStream::connect(addr).expect("the metrics port");
        std::io::Write::write_all(&mut c, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .expect("ask");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut c, &mut out).expect("answer");
        out
    });
    let body = text.split_once("\r\n\r\n").expect("a body").1;
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k.to_owned(), v.parse().expect("a number")))
        .collect()
}

#[test]
fn maructl_remote_lists_gets_and_puts_and_the_memory_node_shows_its_workers() {
    const METRICS: &str = "127.0.0.1:9860";
    let Some(s) = Site::new(&["--metrics", METRICS]) else {
        return;
    };
    let url = s.url.as_str();
    // Entries stored by a worker on node 1, one of them in a namespace below.
    for (ns, key, len, seed) in [
        ("ctl", "k1", "100000", "21"),
        ("ctl", "k2", "4096", "22"),
        ("ctl/sub", "x", "64", "23"),
    ] {
        let r = s.one(1, &["store", url, ns, key, len, seed]);
        assert_eq!(r["stored"], "created", "{r}");
    }

    // maructl --remote from node 2: ls, stat, get, put.
    let ls = ctl_json(&s, 2, &["ls", "ctl"]);
    assert_eq!(ls["children"], serde_json::json!(["sub"]), "{ls}");
    assert_eq!(
        ls["entries"],
        serde_json::json!([{"key": "k1", "size": 100000}, {"key": "k2", "size": 4096}]),
        "{ls}"
    );
    let o = s.maructl(2, &["ls", "ctl"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        format!("sub/\n{:>12} k1\n{:>12} k2\n", 100000, 4096)
    );
    // A namespace of more names than one reply carries: listed whole, in pages.
    let b = s.one(1, &["batch", url, "many", "e", "4200", "64", "5"]);
    assert_eq!(b["equal"], true, "{b}");
    let ls = ctl_json(&s, 2, &["ls", "many"]);
    let listed = ls["entries"].as_array().expect("entries");
    assert_eq!(listed.len(), 4200, "{}", listed.len());
    let mut want: Vec<String> = (0..4200).map(|i| format!("e-{i}")).collect();
    want.sort();
    let keys: Vec<&str> = listed.iter().filter_map(|e| e["key"].as_str()).collect();
    assert_eq!(keys, want);
    assert!(listed.iter().all(|e| e["size"] == 64));
    let st = ctl_json(&s, 2, &["stat", "ctl/k1"]);
    assert_eq!(
        (st["size"].as_u64(), st["exists"].as_bool()),
        (Some(100000), Some(true))
    );
    let missing = s.maructl(2, &["stat", "ctl/nothing"]);
    assert_eq!(missing.status.code(), Some(3), "{missing:?}");
    let o = s.maructl(2, &["get", "ctl/k1"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(o.stdout, pattern(21, 100000));
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("k2");
    let got = ctl_json(
        &s,
        2,
        &["get", "ctl/k2", "-o", file.to_str().expect("utf-8")],
    );
    assert_eq!(got["size"], 4096, "{got}");
    assert_eq!(std::fs::read(&file).expect("read"), pattern(22, 4096));
    assert_eq!(s.maructl(2, &["get", "ctl/nothing"]).status.code(), Some(3));
    // A put, with the token from a file: the memory node has the bytes.
    let value = pattern(24, 300_000);
    let input = dir.path().join("in");
    std::fs::write(&input, &value).expect("write");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write");
    let tf = token_file.to_str().expect("utf-8");
    let put = |host| {
        let o = s.maructl(
            host,
            &[
                "--remote-token-file",
                tf,
                "put",
                "ctl/put",
                input.to_str().expect("utf-8"),
            ],
        );
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert!(put(2).starts_with("created ctl/put"));
    assert_eq!(
        s.local()
            .retrieve("ctl/put")
            .expect("retrieve")
            .expect("found")
            .as_slice(),
        &value[..]
    );
    // Write-once: the same name again is already present, its bytes untouched.
    assert!(put(1).starts_with("already present: ctl/put"));
    let got = s.one(1, &["get", url, "ctl", "put"]);
    assert_eq!(got["sum"], checksum(&value), "{got}");
    // A wrong token: refused, with the local commands' exit code.
    let bad = dir.path().join("bad");
    std::fs::write(&bad, "not-the-token-at-all-xx").expect("write");
    let o = s.maructl(
        2,
        &[
            "--remote-token-file",
            bad.to_str().expect("utf-8"),
            "ls",
            "ctl",
        ],
    );
    assert_eq!(o.status.code(), Some(5), "{o:?}");

    // The memory node: the door in status and the metrics, a holding worker listed with its
    // reservation and read protection while it is connected, and gone once killed.
    let st = status(&s);
    assert_eq!(st["remote"]["addr"], url, "{st}");
    assert_eq!(
        st["remote"]["generation"].as_str().map(str::len),
        Some(16),
        "{st}"
    );
    assert!(door_workers(&st).is_empty(), "{st}");
    let (mut w, line) = s.holder(1, "ctl", "k1");
    assert!(line.contains("\"held\":true"), "{line}");
    let st = status(&s);
    let workers = door_workers(&st);
    assert_eq!(workers.len(), 1, "{st}");
    let h = &workers[0];
    assert_eq!(h["node"], "holder", "{h}");
    assert_eq!(h["identity"], "gpu", "{h}");
    assert_eq!(h["reserved"], 4 << 20, "{h}");
    assert_eq!(h["protected"], 100000, "{h}");
    assert!(
        h["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with(&s.net.host_ip(1))),
        "{h}"
    );
    let text = Command::new(bin("maructl"))
        .arg("--socket")
        .arg(&s.marud.socket)
        .arg("status")
        .output()
        .expect("maructl status");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("remote door: {url}")), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("worker holder") && l.contains("4.0 MiB")),
        "{text}"
    );
    let m = metrics(&s, METRICS);
    let get = |m: &std::collections::BTreeMap<String, f64>, k: &str| {
        *m.get(k).unwrap_or_else(|| panic!("no {k} in {m:?}"))
    };
    assert_eq!(get(&m, "maru_remote_workers"), 1.0);
    assert_eq!(
        get(&m, "maru_remote_workers_reserved_bytes"),
        (4u64 << 20) as f64
    );
    assert_eq!(get(&m, "maru_remote_workers_protected_bytes"), 100000.0);
    // The worker's three stores and batch of 4200, maructl's one store.
    assert_eq!(get(&m, "maru_remote_published_total"), 4204.0);
    assert!(get(&m, "maru_remote_connections_total") >= 12.0, "{m:?}");
    // The bad token, and the probe that waited for the door to open (gone before its hello).
    assert!(get(&m, "maru_remote_refused_total") >= 1.0, "{m:?}");
    assert!(get(&m, "maru_remote_lookups_total") >= 4.0, "{m:?}");
    w.0.kill().expect("kill -9");
    let _ = w.0.wait();
    wait_until(
        "the killed worker off the list",
        Duration::from_secs(5),
        || door_workers(&status(&s)).is_empty(),
    );
    let m = metrics(&s, METRICS);
    assert_eq!(get(&m, "maru_remote_workers"), 0.0);
    assert_eq!(get(&m, "maru_remote_workers_reserved_bytes"), 0.0);
}
