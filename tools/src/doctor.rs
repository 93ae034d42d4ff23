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
//! This module reads the configuration, runs the checks and prints the report; what they
//! share (the target, a report line, the time limit) is in `target`; the checks
//! are in `kernel` (FUSE), `memory` (huge pages, NUMA nodes, DAX devices and raw pools),
//! `service` (marud, the mount, the state directory, the group, etcd) and `nixl`. What
//! they read of the kernel they read through [`maru::host`], as marud and maru-fsd do.

use std::path::Path;
use std::process::ExitCode;

use maru::daemon_config::{DEFAULT_CONFIG, FileConfig};
use serde::Serialize;

mod kernel;
mod memory;
mod nixl;
mod service;
mod target;

pub use target::{Check, Status, Target};

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

#[cfg(test)]
mod tests {
    use super::*;
    use maru::daemon_config::DEFAULT_SOCKET;

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
}
