//! `maructl doctor`: what a new operator runs first. It holds this host against marud's
//! configuration (`--config`, else `/etc/maru/marud.toml` where it exists, else marud's
//! built-in defaults) and says, one line per check, what works and what to do where something
//! does not: a name, a status ([`Status`]), what it found and, for `warn` and `fail`, one
//! remedy (a command or a setting). doc/OPERATIONS.md explains each check.
//!
//! The exit status is 0 only when no line is `fail`: the configured system can run here.
//!
//! Every probe is bounded in time: one that may block in the kernel or on a peer (the control
//! socket, the mount, the state directory's filesystem, etcd, a DAX device, NIXL's search)
//! runs under `bounded` or with its own timeout, so a dead socket or an unreachable etcd
//! costs a few seconds and a `fail` line, never a hang. Nothing here writes anywhere.
//!
//! This module reads the configuration, runs the checks and prints the report; the checks
//! are in `kernel` (FUSE), `memory` (huge pages, NUMA nodes, DAX devices and raw pools),
//! `service` (marud, the mount, the state directory, the group, etcd) and `nixl`. What
//! they read of the kernel they read through [`maru::host`], as marud and maru-fsd do.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use maru::daemon_config::{DEFAULT_CONFIG, DEFAULT_MOUNT, DEFAULT_POOL, DEFAULT_SOCKET};
use maru::daemon_config::{DEFAULT_STATE_DIR, FileConfig};
use serde::Serialize;

mod kernel;
mod memory;
mod nixl;
mod service;

/// How long one probe may take (a socket round trip, a `stat`, one etcd endpoint, Python).
const LIMIT: Duration = Duration::from_secs(3);

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
    fn new(name: &str, status: Status, detail: impl Into<String>, remedy: Option<String>) -> Self {
        let name = name.to_owned();
        Check {
            name,
            status,
            detail: detail.into(),
            remedy,
        }
    }
    fn ok(name: &str, detail: impl Into<String>) -> Self {
        Check::new(name, Status::Ok, detail, None)
    }
    fn skip(name: &str, detail: impl Into<String>) -> Self {
        Check::new(name, Status::Skip, detail, None)
    }
    fn warn(name: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Self {
        Check::new(name, Status::Warn, detail, Some(remedy.into()))
    }
    fn fail(name: &str, detail: impl Into<String>, remedy: impl Into<String>) -> Self {
        Check::new(name, Status::Fail, detail, Some(remedy.into()))
    }
}

/// A pool of the configuration, as far as the checks need it (marud parses the full spec).
#[derive(Debug, PartialEq, Eq)]
struct Pool {
    /// `memfs`, `devdax` or `file`.
    kind: String,
    path: PathBuf,
    /// `numa=N` of a memfs pool.
    numa: Option<u32>,
    /// `huge=` of a memfs pool (marud's default: `within_size`).
    huge: String,
}

/// `KIND:PATH[,key=value...]` (doc: `marud --help`).
fn parse_pool(spec: &str) -> Pool {
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
    file: FileConfig,
    socket: PathBuf,
    mount: Option<PathBuf>,
    state_dir: PathBuf,
    pools: Vec<Pool>,
    /// etcd endpoints (cluster mode); empty on a single host.
    cluster: Vec<String>,
}

impl Target {
    /// marud's settings from its config file over its defaults; `socket` (maructl's
    /// `--socket` or `MARU_SOCKET`) wins over the file's.
    fn new(file: FileConfig, socket: Option<&Path>) -> Self {
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

    fn memfs(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter().filter(|p| p.kind == "memfs")
    }
}

/// Reads the configuration marud would read: `config`, else [`DEFAULT_CONFIG`] where it
/// exists, else none (marud's defaults). Returns the target and the `config` line; a file
/// that does not read or parse is a `fail` (marud refuses it too), the rest then checked
/// against the defaults.
pub fn load(config: Option<&Path>, socket: Option<&Path>) -> (Target, Check) {
    const NAME: &str = "config";
    let path = config.map(Path::to_owned).or_else(|| {
        let p = Path::new(DEFAULT_CONFIG);
        p.exists().then(|| p.to_owned())
    });
    let Some(path) = path else {
        let line = Check::ok(
            NAME,
            format!("no {DEFAULT_CONFIG}: marud's built-in defaults"),
        );
        return (Target::new(FileConfig::default(), socket), line);
    };
    let shown = path.display();
    let (file, line) = match std::fs::read_to_string(&path) {
        Err(e) => (
            None,
            Check::fail(
                NAME,
                format!("cannot read {shown}: {e}"),
                "give marud's config file with --config PATH",
            ),
        ),
        Ok(text) => match toml::from_str::<FileConfig>(&text) {
            Ok(f) => (
                Some(f),
                Check::ok(NAME, format!("{shown}: read as marud reads it")),
            ),
            Err(e) => (
                None,
                Check::fail(
                    NAME,
                    format!("{shown}: {}", e.message().replace('\n', " ")),
                    "fix that key: marud refuses to start with this file (packaging/marud.toml has every key)",
                ),
            ),
        },
    };
    (Target::new(file.unwrap_or_default(), socket), line)
}

/// Runs every check against `t`, in the order the report shows them.
pub fn run(t: &Target) -> Vec<Check> {
    let mut c = kernel::fuse(t);
    c.push(memory::huge_pages(t));
    c.extend(memory::numa(t));
    c.extend(memory::dax(t));
    let (daemon, up) = service::marud(t);
    c.push(daemon);
    c.push(service::mount(t, up));
    c.push(service::state_dir(t));
    c.push(service::group(t));
    c.push(service::etcd(t));
    c.push(nixl::nixl(t));
    c
}

/// The JSON report: `ok` first, then the checks, each `{"name", "status", "detail", "remedy"}`.
#[derive(Serialize)]
struct Report<'a> {
    ok: bool,
    checks: &'a [Check],
}

/// `maructl doctor`: loads, checks, prints (text, or with `json` one JSON object
/// `{"ok", "checks": [{"name", "status", "detail", "remedy"}]}`) and exits 0 when no check
/// failed, 1 otherwise.
pub fn main(config: Option<&Path>, socket: Option<&Path>, json: bool) -> ExitCode {
    let (target, first) = load(config, socket);
    let mut checks = vec![first];
    checks.extend(run(&target));
    let ok = checks.iter().all(|c| c.status != Status::Fail);
    if json {
        let doc = Report {
            ok,
            checks: &checks,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serializable")
        );
    } else {
        print!("{}", text(&checks, ok));
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The report for people: one line per check, its remedy on the next, a summary last.
fn text(checks: &[Check], ok: bool) -> String {
    let mut s = String::new();
    for c in checks {
        s.push_str(&format!(
            "{:<5} {:<18} {}\n",
            c.status.as_str(),
            c.name,
            c.detail
        ));
        if let Some(r) = &c.remedy {
            s.push_str(&format!("{:<24}fix: {r}\n", ""));
        }
    }
    let n = |st| checks.iter().filter(|c| c.status == st).count();
    s.push_str(&format!(
        "{} ok, {} warn, {} fail, {} skipped: {}\n",
        n(Status::Ok),
        n(Status::Warn),
        n(Status::Fail),
        n(Status::Skip),
        if ok {
            "marud can run here"
        } else {
            "fix the fail lines first"
        }
    ));
    s
}

/// Runs `probe` on a thread of its own and waits at most `limit` for it. A probe stuck in
/// the kernel (a `stat` of a FUSE mount whose daemon hangs, a filesystem that stopped
/// answering, a socket peer that accepts and never replies) then costs its check, not the
/// command; the stuck thread is left behind and ends with the process.
fn bounded<T: Send + 'static>(
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

fn is_root() -> bool {
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
    fn a_config_marud_refuses_fails() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("marud.toml");
        std::fs::write(&p, "socket = \"/s\"\n").unwrap();
        let (t, c) = load(Some(&p), None);
        assert_eq!((c.status, t.socket.to_str()), (Status::Ok, Some("/s")));
        std::fs::write(&p, "sockett = \"/s\"\n").unwrap();
        let (t, c) = load(Some(&p), None);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("sockett"), "{}", c.detail);
        assert_eq!(t.socket.to_str(), Some(DEFAULT_SOCKET));
        assert_eq!(
            load(Some(&dir.path().join("none")), None).1.status,
            Status::Fail
        );
    }

    #[test]
    fn the_text_report() {
        let checks = [
            Check::ok("a", "fine"),
            Check::fail("b", "broken", "mend it"),
        ];
        assert_eq!(
            text(&checks, false),
            "ok    a                  fine\nfail  b                  broken\n                        fix: mend it\n\
             1 ok, 0 warn, 1 fail, 0 skipped: fix the fail lines first\n"
        );
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
