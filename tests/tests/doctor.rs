//! `maructl doctor` end to end: a healthy host (marud running with a memfs pool and its
//! mount), no daemon, a stale socket, a group that does not exist, an unreachable etcd. Each
//! test writes its own config (the host's /etc/maru/marud.toml is never read) and starts only
//! its own marud, which [`Daemon`] stops and unmounts on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use maru_tests::{Daemon, Opts, bin};
use serde_json::Value;

/// Runs `maructl doctor --json --config CONFIG ARGS...`: its exit code and its report.
fn doctor(config: &Path, args: &[&str]) -> (Option<i32>, Value) {
    doctor_with(config, args, &[])
}

/// [`doctor`] with variables `env` set.
fn doctor_with(config: &Path, args: &[&str], env: &[(&str, &Path)]) -> (Option<i32>, Value) {
    let o = Command::new(bin("maructl"))
        .args(["doctor", "--json", "--config"])
        .arg(config)
        .args(args)
        .env_remove("MARU_SOCKET")
        .envs(env.iter().copied())
        .output()
        .expect("running maructl doctor");
    let report = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "maructl doctor printed no JSON report ({e}): {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (o.status.code(), report)
}

/// The check named `name` of a report.
fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .expect("a list of checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no `{name}` check in {report:#}"))
}

/// Writes `body` as marud.toml in `dir`; the state directory is under `dir` too.
fn config(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("marud.toml");
    let state = dir.join("state");
    let text = format!("state_dir = \"{}\"\n{body}", state.display());
    std::fs::write(&p, text).expect("writing the config");
    p
}

/// Asserts the report failed on `name` only for a reason, with a remedy, and said so in its
/// exit status.
fn fails_on<'a>(code: Option<i32>, report: &'a Value, name: &str) -> &'a Value {
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(report["ok"], false, "{report:#}");
    let c = check(report, name);
    assert_eq!(c["status"], "fail", "{report:#}");
    assert!(c["remedy"].as_str().is_some_and(|r| !r.is_empty()), "{c:#}");
    c
}

#[test]
fn a_healthy_host_passes() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M,name=mem".into()],
        mount: true,
        extra: vec![],
    });
    let mnt = d.mount.as_ref().expect("mounted");
    let body = format!(
        "pools = [\"memfs:{}/pool,size=64M,name=mem\"]\nmount = \"{}\"\nsocket = \"{}\"\n",
        d.dir.display(),
        mnt.display(),
        d.socket.display()
    );
    let cfg = config(&d.dir, &body);
    let (code, report) = doctor(&cfg, &[]);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(check(&report, "config")["status"], "ok");
    let marud = check(&report, "marud");
    assert_eq!(marud["status"], "ok", "{report:#}");
    let detail = marud["detail"].as_str().expect("a detail");
    assert!(detail.contains("mem (memfs"), "{detail}");
    assert!(detail.contains(&mnt.display().to_string()), "{detail}");
    assert_eq!(check(&report, "mount")["status"], "ok", "{report:#}");
    assert_eq!(check(&report, "etcd")["status"], "skip");
    // Every line has the four fields; only warn and fail lines carry a remedy.
    for c in report["checks"].as_array().expect("checks") {
        let status = c["status"].as_str().expect("a status");
        assert!(["ok", "warn", "fail", "skip"].contains(&status), "{c}");
        assert!(c["name"].is_string() && c["detail"].is_string(), "{c}");
        if status == "warn" || status == "fail" {
            assert!(c["remedy"].is_string(), "{c}");
        }
    }
    // The same for people, ending with the verdict.
    let o = Command::new(bin("maructl"))
        .args(["doctor", "--config"])
        .arg(&cfg)
        .output()
        .expect("running maructl doctor");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("ok    marud ")),
        "{text}"
    );
    assert!(text.trim_end().ends_with("marud can run here"), "{text}");
}

#[test]
fn no_daemon_fails_with_how_to_start_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("marud.sock");
    let body = format!("no_mount = true\nsocket = \"{}\"\n", sock.display());
    let (code, report) = doctor(&config(dir.path(), &body), &[]);
    let c = fails_on(code, &report, "marud");
    assert!(c["detail"].as_str().unwrap().contains("no marud"), "{c:#}");
    assert!(
        c["remedy"]
            .as_str()
            .unwrap()
            .contains("systemctl start marud"),
        "{c:#}"
    );
    assert_eq!(check(&report, "fuse")["status"], "skip");
}

#[test]
fn a_stale_socket_is_named_stale() {
    let dir = tempfile::tempdir().expect("temp dir");
    let stale = dir.path().join("stale.sock");
    // Bound, then closed: the file stays and nobody listens on it.
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("binding"));
    assert!(stale.exists());
    let body = format!(
        "no_mount = true\nsocket = \"{}\"\n",
        dir.path().join("other.sock").display()
    );
    let t = Instant::now();
    // --socket wins over the config's socket, as for every maructl command.
    let (code, report) = doctor(
        &config(dir.path(), &body),
        &["--socket", stale.to_str().unwrap()],
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    let c = fails_on(code, &report, "marud");
    let detail = c["detail"].as_str().unwrap();
    assert!(
        detail.contains("stale") && detail.contains("stale.sock"),
        "{c:#}"
    );
    assert!(c["remedy"].as_str().unwrap().contains("restart"), "{c:#}");
}

#[test]
fn a_group_that_does_not_exist_fails() {
    let dir = tempfile::tempdir().expect("temp dir");
    let group = "maru-doctor-no-such-group";
    assert!(
        nix::unistd::Group::from_name(group)
            .expect("group lookup")
            .is_none()
    );
    let body = format!("no_mount = true\ngroup = \"{group}\"\n");
    let (code, report) = doctor(&config(dir.path(), &body), &[]);
    let c = fails_on(code, &report, "group");
    assert!(c["detail"].as_str().unwrap().contains(group), "{c:#}");
    assert!(
        c["remedy"]
            .as_str()
            .unwrap()
            .contains(&format!("groupadd --system {group}")),
        "{c:#}"
    );
}

#[test]
fn an_unreachable_etcd_fails_quickly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let body = format!(
        "no_mount = true\npools = [\"file:{}/pool.img,size=64M\"]\ncluster = \"http://127.0.0.1:1\"\nnode = \"a\"\n",
        dir.path().display()
    );
    let t = Instant::now();
    let (code, report) = doctor(&config(dir.path(), &body), &[]);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let c = fails_on(code, &report, "etcd");
    assert!(
        c["detail"].as_str().unwrap().contains("127.0.0.1:1"),
        "{c:#}"
    );
}

#[test]
fn a_healthy_etcd_is_named_with_its_version() {
    let Some(etcd) = maru_cluster::testing::Etcd::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let body = format!(
        "no_mount = true\npools = [\"file:{}/pool.img,size=64M\"]\ncluster = \"{}\"\nnode = \"a\"\n",
        dir.path().display(),
        etcd.endpoints().join(",")
    );
    let (_, report) = doctor(&config(dir.path(), &body), &[]);
    let c = check(&report, "etcd");
    assert_eq!(c["status"], "ok", "{c:#}");
    let detail = c["detail"].as_str().expect("detail");
    assert!(
        detail.contains("etcd 3.") && detail.contains("healthy"),
        "{c:#}"
    );
}

#[test]
fn nixl_is_looked_for_where_the_remote_tier_looks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("libnixl_capi.so");
    std::fs::write(&lib, b"").expect("writing");
    let cfg = config(dir.path(), "no_mount = true\n");
    let (_, report) = doctor_with(&cfg, &[], &[("MARU_NIXL_LIB", &lib)]);
    let c = check(&report, "nixl");
    assert_eq!(c["status"], "ok", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains(&lib.display().to_string()),
        "{c:#}"
    );
}
