//! The cluster under test: a three-member etcd, each member in a network namespace of its
//! own, and marud hosts, each a host of a network namespace of its own (and a mount namespace
//! of its own), sharing one `file:` pool; all joined by a bridge in a hub namespace. Everything goes when the environment drops, panics included: the
//! daemons and etcd members are killed by pid, the namespaces (and their veths) deleted, the
//! pool file and directories removed.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use maru_cluster::testing::{EtcdCluster, Net};

use crate::{Daemon, Opts, bin};

pub const POOL_SIZE: u64 = 256 << 20;

/// Etcd members, each in a network namespace of its own.
pub const MEMBERS: usize = 3;

pub struct Env {
    // Drop order: daemons, then etcd, then the namespaces.
    pub hosts: Vec<Mutex<Daemon>>,
    pub etcd: Mutex<EtcdCluster>,
    pub net: Net,
    pub pool: PathBuf,
    pub ttl: Duration,
    _dir: tempfile::TempDir,
}

impl Env {
    /// `hosts` marud hosts on a fresh pool, logging at `log` (`MARU_LOG`; by default
    /// `MARU_TEST_LOG`, else `info`); None (skip) without root or etcd outside CI.
    pub fn start(hosts: usize, ttl: Duration, log: Option<&str>) -> Option<Env> {
        let net = Net::with_members(hosts, MEMBERS)?;
        let places: Vec<_> = (0..MEMBERS).map(|m| net.member_place(m)).collect();
        let etcd = EtcdCluster::start(Some(&net.hub), &places, 2379)?;
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = dir.path().join("cxl.img");
        std::fs::File::create(&pool)
            .and_then(|f| f.set_len(POOL_SIZE))
            .expect("pool file");
        let out = std::process::Command::new(bin("maructl"))
            .args(["device", "init"])
            .arg(&pool)
            .output()
            .expect("maructl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let endpoints = etcd.endpoints().join(",");
        let daemons = (0..hosts)
            .map(|i| {
                Mutex::new(Daemon::start_host(
                    Opts {
                        pools: vec![format!("file:{},size={POOL_SIZE}", pool.display())],
                        mount: true,
                        extra: vec![
                            "--cluster".into(),
                            endpoints.clone(),
                            "--node".into(),
                            format!("h{i}"),
                            "--cluster-ttl".into(),
                            ttl.as_secs().to_string(),
                            "--eviction".into(),
                            "off".into(),
                            // A killed marud serving FUSE over io_uring can hang in the kernel.
                            "--fuse-uring".into(),
                            "off".into(),
                        ],
                    },
                    &net.hosts[i],
                    &log.map(|l| vec![("MARU_LOG", l)]).unwrap_or_default(),
                ))
            })
            .collect();
        Some(Env {
            hosts: daemons,
            etcd: Mutex::new(etcd),
            net,
            pool,
            ttl,
            _dir: dir,
        })
    }

    /// Host `i`'s control socket (it stays across restarts).
    pub fn socket(&self, i: usize) -> PathBuf {
        self.hosts[i].lock().expect("host").socket.clone()
    }

    /// Whether etcd holds host `i`'s node record, which lives with its lease (as do its
    /// claims): false once etcd dropped the lease. Asked of any member but `minority` (a
    /// member cut from the others) that answers; true when none does (nothing known).
    pub fn node_alive(&self, i: usize, minority: Option<usize>) -> bool {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = format!(
            r#"{{"key":"{}","range_end":"{}","keys_only":true}}"#,
            b64.encode("/maru/"),
            b64.encode("/maru0")
        );
        let suffix = format!("/nodes/h{i}");
        let etcd = self.etcd.lock().expect("etcd");
        for m in (0..etcd.len()).filter(|&m| Some(m) != minority) {
            let Some(reply) = etcd
                .http(m, "POST", "/v3/kv/range", &body)
                .filter(|r| r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200"))
            else {
                continue;
            };
            let Some(json) = reply
                .split_once("\r\n\r\n")
                .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(b).ok())
            else {
                continue;
            };
            let kvs = json["kvs"].as_array().cloned().unwrap_or_default();
            return kvs.iter().any(|kv| {
                kv["key"]
                    .as_str()
                    .and_then(|k| b64.decode(k).ok())
                    .is_some_and(|k| k.ends_with(suffix.as_bytes()))
            });
        }
        true
    }

    /// Every key under `/maru/` whose path (after the pool's id) starts with one of
    /// `kinds` (`regions/`, `maps/`), with its value: asked of any member that answers.
    pub fn etcd_keys(&self, kinds: &[&str]) -> Vec<(String, String)> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = format!(
            r#"{{"key":"{}","range_end":"{}"}}"#,
            b64.encode("/maru/"),
            b64.encode("/maru0")
        );
        let etcd = self.etcd.lock().expect("etcd");
        for m in 0..etcd.len() {
            let Some(json) = etcd
                .http(m, "POST", "/v3/kv/range", &body)
                .and_then(|r| r.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()))
                .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            else {
                continue;
            };
            let text = |v: &serde_json::Value| {
                v.as_str()
                    .and_then(|s| b64.decode(s).ok())
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default()
            };
            let kvs = json["kvs"].as_array().cloned().unwrap_or_default();
            return kvs
                .iter()
                .map(|kv| (text(&kv["key"]), text(&kv["value"])))
                .filter(|(k, _)| {
                    // /maru/<pool>/<kind>...
                    let rest = k.splitn(4, '/').nth(3).unwrap_or("");
                    kinds.iter().any(|p| rest.starts_with(p))
                })
                .collect();
        }
        Vec::new()
    }

    /// A client of host `i`, waiting (up to `wait`) for the host to serve.
    pub fn connect(&self, i: usize, wait: Duration) -> Option<maru::Handler> {
        connect(&self.socket(i), wait)
    }
}

/// A client of the marud at `socket`, retried for up to `wait`.
pub fn connect(socket: &std::path::Path, wait: Duration) -> Option<maru::Handler> {
    let t = std::time::Instant::now();
    loop {
        let cfg = maru::Config {
            socket: socket.to_owned(),
            ..Default::default()
        };
        if let Ok(h) = maru::Handler::connect(cfg) {
            return Some(h);
        }
        if t.elapsed() > wait {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
