//! What the checks share: the target they hold the host against (marud's settings as far as
//! they matter here), one line of the report, and the time limit of a probe.

use std::path::{Path, PathBuf};
use std::time::Duration;

use maru::daemon_config::FileConfig;
use maru::daemon_config::{DEFAULT_MOUNT, DEFAULT_POOL, DEFAULT_SOCKET, DEFAULT_STATE_DIR};
use serde::Serialize;

/// How long one probe may take (a socket round trip, a `stat`, one etcd endpoint, Python).
pub(super) const LIMIT: Duration = Duration::from_secs(3);

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Works (or is information).
    Ok,
    /// Works, but slower or narrower than it could: the remedy says how to get the rest.
    Warn,
    /// The configured system cannot run (or cannot be used) until the remedy is applied.
    Fail,
    /// Does not apply to this configuration.
    Skip,
}

impl Status {
    /// As printed: `ok`, `warn`, `fail`, `skip`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked (`fuse`, `marud`, `numa/node1`...).
    pub name: String,
    /// Its outcome.
    pub status: Status,
    /// What was found, on one line.
    pub detail: String,
    /// What to do, on one line (always for `warn` and `fail`).
    pub remedy: Option<String>,
}

impl Check {
    pub(super) fn new(
        name: &str,
        status: Status,
        detail: impl Into<String>,
        remedy: Option<String>,
    ) -> Self {
        let name = name.to_owned();
        Check {
            name,
            status,
            detail: detail.into(),
            remedy,
        }
    }
    pub(super) fn ok(name: &str, detail: impl Into<String>) -> Self {
        Check::new(name, Status::Ok, detail, None)
    }
    pub(super) fn skip(name: &str, detail: impl Into<String>) -> Self {
        Check::new(name, Status::Skip, detail, None)
    }
    pub(super) fn warn(name: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Self {
        Check::new(name, Status::Warn, detail, Some(remedy.into()))
    }
    pub(super) fn fail(name: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Self {
        Check::new(name, Status::Fail, detail, Some(remedy.into()))
    }
}

/// A pool of the configuration, as far as the checks need it (marud parses the full spec).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Pool {
    /// `memfs`, `devdax` or `file`.
    pub(super) kind: String,
    pub(super) path: PathBuf,
    /// `numa=N` of a memfs pool.
    pub(super) numa: Option<u32>,
    /// `huge=` of a memfs pool (marud's default: `within_size`).
    pub(super) huge: String,
}

/// `KIND:PATH[,key=value...]` (doc: `marud --help`).
pub(super) fn parse_pool(spec: &str) -> Pool {
    let (kind, rest) = spec.split_once(':').unwrap_or(("memfs", spec));
    let mut parts = rest.split(',');
    let path = PathBuf::from(parts.next().unwrap_or_default());
    let (mut numa, mut huge) = (None, "within_size".to_owned());
    for (k, v) in parts.filter_map(|p| p.split_once('=')) {
        match k {
            "numa" => numa = v.parse().ok(),
            "huge" => huge = v.to_owned(),
            _ => {}
        }
    }
    Pool {
        kind: kind.to_owned(),
        path,
        numa,
        huge,
    }
}

/// What the checks hold the host against: marud's settings as far as they matter here.
pub struct Target {
    pub(super) file: FileConfig,
    pub(super) socket: PathBuf,
    pub(super) mount: Option<PathBuf>,
    pub(super) state_dir: PathBuf,
    pub(super) pools: Vec<Pool>,
    /// etcd endpoints (cluster mode); empty on a single host.
    pub(super) cluster: Vec<String>,
}

impl Target {
    /// marud's settings from its config file over its defaults; `socket` (maructl's
    /// `--socket` or `MARU_SOCKET`) wins over the file's.
    pub(super) fn new(file: FileConfig, socket: Option<&Path>) -> Self {
        let specs = if file.pools.is_empty() {
            vec![DEFAULT_POOL.to_owned()]
        } else {
            file.pools.clone()
        };
        let mount = (!file.no_mount.unwrap_or(false))
            .then(|| file.mount.clone().unwrap_or_else(|| DEFAULT_MOUNT.into()));
        Target {
            socket: socket
                .map(Path::to_owned)
                .or_else(|| file.socket.clone())
                .unwrap_or_else(|| DEFAULT_SOCKET.into()),
            mount,
            state_dir: file
                .state_dir
                .clone()
                .unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            pools: specs.iter().map(|s| parse_pool(s)).collect(),
            cluster: file
                .cluster
                .as_deref()
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect(),
            file,
        }
    }

    pub(super) fn memfs(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter().filter(|p| p.kind == "memfs")
    }
}

/// Runs `probe` on a thread of its own and waits at most `limit` for it. A probe stuck in
/// the kernel (a `stat` of a FUSE mount whose daemon hangs, a filesystem that stopped
/// answering, a socket peer that accepts and never replies) then costs its check, not the
/// command; the stuck thread is left behind and ends with the process.
pub(super) fn bounded<T: Send + 'static>(
    limit: Duration,
    probe: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("maru-doctor".into())
        .spawn(move || {
            let _ = tx.send(probe());
        })
        .ok()?;
    rx.recv_timeout(limit).ok()
}

pub(super) fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_parse() {
        let p = parse_pool("memfs:/run/maru/pool0,size=4G,huge=always,numa=1");
        assert_eq!(
            p,
            Pool {
                kind: "memfs".into(),
                path: "/run/maru/pool0".into(),
                numa: Some(1),
                huge: "always".into()
            }
        );
        let p = parse_pool("devdax:/dev/dax0.0,name=cxl");
        assert_eq!(
            (p.kind.as_str(), p.path.to_str(), p.numa),
            ("devdax", Some("/dev/dax0.0"), None)
        );
    }

    #[test]
    fn defaults_and_overrides() {
        let t = Target::new(FileConfig::default(), None);
        assert_eq!(
            (t.socket.to_str(), t.mount.as_deref()),
            (Some(DEFAULT_SOCKET), Some(Path::new("/maru")))
        );
        assert_eq!(t.pools[0].path, Path::new("/run/maru/pool0"));
        let f: FileConfig = toml::from_str(
            "no_mount = true\nsocket = \"/s\"\ncluster = \"http://a:1, http://b\"\n",
        )
        .unwrap();
        let t = Target::new(f, Some(Path::new("/flag")));
        assert_eq!(
            (t.socket.to_str(), t.mount.is_none()),
            (Some("/flag"), true)
        );
        assert_eq!(t.cluster, ["http://a:1", "http://b"]);
    }

    #[test]
    fn a_stuck_probe_costs_its_limit_only() {
        let t = std::time::Instant::now();
        let stuck = || std::thread::sleep(Duration::from_secs(5));
        assert_eq!(bounded(Duration::from_millis(50), stuck), None);
        assert!(t.elapsed() < Duration::from_secs(2));
        assert_eq!(bounded(LIMIT, || 7), Some(7));
    }
}
