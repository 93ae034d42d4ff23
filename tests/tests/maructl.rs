//! maructl against a live daemon: every command, its --json output, exit codes and errors.

use std::process::{Command, Output};

use maru_tests::{Daemon, Opts, bin, pattern};
use serde_json::Value;

fn ctl(d: &Daemon, args: &[&str]) -> Output {
    Command::new(bin("maructl"))
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .output()
        .expect("running maructl")
}

fn json(d: &Daemon, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let o = ctl(d, &a);
    assert!(
        o.status.success(),
        "maructl {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("maructl {args:?} printed no JSON: {e}"))
}

fn fails(d: &Daemon, args: &[&str], code: i32, kind: &str) {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let o = ctl(d, &a);
    assert_eq!(
        o.status.code(),
        Some(code),
        "maructl {args:?}: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let v: Value = serde_json::from_slice(&o.stdout).expect("error as JSON");
    assert_eq!(v["error"]["kind"], kind, "{v}");
    // And for people: a message on stderr, nothing on stdout.
    let o = ctl(d, args);
    assert_eq!(o.status.code(), Some(code));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("maructl: "));
}

#[test]
fn every_command_against_a_live_daemon() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M,name=mem".into()],
        mount: false,
        extra: vec![],
    });
    let st = json(&d, &["status"]);
    assert!(st["server"].as_str().unwrap().starts_with("marud"));
    assert_eq!(st["pools"][0]["name"], "mem");
    let pools = json(&d, &["pools"]);
    assert_eq!(pools["pools"][0]["kind"], "memfs");
    assert_eq!(pools["pools"][0]["capacity"], 64 << 20);

    json(&d, &["mkdir", "ns", "--mode", "750"]);
    let src = d.dir.join("in.bin");
    std::fs::write(&src, pattern(1, 300_000)).unwrap();
    let put = json(&d, &["put", "ns/k", src.to_str().unwrap()]);
    assert_eq!(put["size"], 300_000);
    // put from stdin, get to stdout.
    let mut child = Command::new(bin("maructl"))
        .args(["--socket", d.socket.to_str().unwrap(), "put", "ns/stdin"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin")
        .unwrap();
    assert!(child.wait().unwrap().success());
    let o = ctl(&d, &["get", "ns/stdin"]);
    assert!(o.status.success());
    assert_eq!(o.stdout, b"from stdin");
    // get to a file round-trips the bytes.
    let dst = d.dir.join("out.bin");
    let got = json(&d, &["get", "ns/k", dst.to_str().unwrap()]);
    assert_eq!(got["size"], 300_000);
    assert_eq!(std::fs::read(&dst).unwrap(), pattern(1, 300_000));

    let ls = json(&d, &["ls"]);
    assert_eq!(ls["children"][0]["ns"], "ns");
    assert_eq!(ls["children"][0]["mode"], 0o750);
    let ls = json(&d, &["ls", "ns"]);
    let keys: Vec<&str> = ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["k", "stdin"]);
    let s = json(&d, &["stat", "ns/k"]);
    assert_eq!(s["size"], 300_000);
    assert_eq!(s["pinned"], false);
    assert_eq!(s["pool"], "mem");

    json(&d, &["pin", "ns/k"]);
    assert_eq!(json(&d, &["stat", "ns/k"])["pinned"], true);
    json(&d, &["unpin", "ns/k"]);
    assert_eq!(json(&d, &["stat", "ns/k"])["pinned"], false);

    // Evict: everything unpinned goes when asked for the whole pool.
    json(&d, &["pin", "ns/stdin"]);
    let ev = json(&d, &["evict", "--bytes", "64M"]);
    assert_eq!(ev["entries"], 1);
    fails(&d, &["stat", "ns/k"], 3, "not_found");
    json(&d, &["unpin", "ns/stdin"]);

    let rm = json(&d, &["rm", "ns/stdin"]);
    assert_eq!(rm["results"][0]["ok"], true);

    // Quota: set, shown by ls, enforced with EDQUOT's exit code, cleared.
    assert_eq!(json(&d, &["quota", "ns", "4K"])["quota"], 4096);
    assert_eq!(json(&d, &["ls", "ns"])["ns"]["quota"], 4096);
    let big = d.dir.join("big");
    std::fs::write(&big, pattern(9, 8192)).unwrap();
    let o = ctl(&d, &["--json", "put", "ns/big", big.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("quota"),
        "{o:?}"
    );
    assert!(json(&d, &["quota", "ns", "none"])["quota"].is_null());
    json(&d, &["rmdir", "ns"]);
    assert!(json(&d, &["ls"])["children"].as_array().unwrap().is_empty());
}

#[test]
fn errors_are_clear_and_exit_non_zero() {
    maru_tests::require_root!();
    let mut d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M".into()],
        mount: false,
        extra: vec![],
    });
    json(&d, &["mkdir", "e"]);
    fails(&d, &["get", "e/missing", "/dev/null"], 3, "not_found");
    fails(&d, &["stat", "e/missing"], 3, "not_found");
    fails(&d, &["rm", "e/missing"], 3, "not_found");
    fails(&d, &["put", "e/..", "/dev/null"], 8, "invalid_name");
    fails(&d, &["put", "nokey", "/dev/null"], 8, "invalid_name");
    let long = format!("e/{}", "x".repeat(256));
    fails(&d, &["stat", &long], 8, "name_too_long");
    json(&d, &["put", "e/k", "/etc/hostname"]);
    fails(&d, &["put", "e/k", "/etc/hostname"], 6, "exists");
    fails(&d, &["mkdir", "e"], 6, "exists");
    fails(&d, &["evict", "--bytes", "lots"], 8, "invalid_argument");
    // A usage error is exit 2 (clap).
    let o = ctl(&d, &["frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    // A stopped daemon.
    d.stop();
    fails(&d, &["status"], 4, "unreachable");
    let o = ctl(&d, &["status"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("is it running?"));
}

/// A daemon on a 16 MiB raw pool in a file, and that file's path.
fn daemon_on_a_device_file() -> (Daemon, String) {
    let d = Daemon::start(Opts {
        pools: vec!["file:{dir}/dev.img,size=16M".into()],
        mount: false,
        extra: vec![],
    });
    let dev = d.dir.join("dev.img").to_str().unwrap().to_owned();
    (d, dev)
}

#[test]
fn device_header_init_show_clear() {
    let (mut d, dev) = daemon_on_a_device_file();
    let dev = dev.as_str();
    // marud initialized the header of its new pool.
    let show = json(&d, &["device", "show", dev]);
    assert_eq!(show["initialized"], true);
    assert_eq!(show["version"], 1);
    let uuid = show["uuid"].as_str().unwrap().to_owned();
    // Refused while a daemon uses the device.
    fails(&d, &["device", "clear", dev], 9, "busy");
    fails(&d, &["device", "init", dev, "--force"], 9, "busy");
    d.stop();
    fails(&d, &["device", "init", dev], 6, "exists");
    let init = json(&d, &["device", "init", dev, "--force"]);
    assert_ne!(init["uuid"], uuid.as_str());
    assert_eq!(json(&d, &["device", "show", dev])["uuid"], init["uuid"]);
    json(&d, &["device", "clear", dev]);
    assert_eq!(json(&d, &["device", "show", dev])["initialized"], false);
    let bytes = std::fs::read(dev).unwrap();
    assert!(bytes[..32].iter().all(|b| *b == 0));
    json(&d, &["device", "init", dev]);
    assert_eq!(&std::fs::read(dev).unwrap()[..8], b"MARUDEV\0");
    fails(&d, &["device", "show", "/nonexistent/dev"], 3, "io");
}

/// `marutop device` (the original design's spelling) is `maructl device`: for every case, the
/// same exit code, the same stdout and the same stderr but for the program's name.
#[test]
fn marutop_device_is_maructl_device() {
    let (mut d, dev) = daemon_on_a_device_file();
    let dev = dev.as_str();
    let socket = d.socket.clone();
    let run = |prog: &str, args: &[&str]| {
        Command::new(bin(prog))
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {prog}: {e}"))
    };
    // Runs both and returns marutop's exit code and stdout once they are checked equal.
    let both = |args: &[&str]| {
        let ctl = run("maructl", args);
        let top = run("marutop", args);
        let text = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(
            (top.status.code(), text(&top)),
            (ctl.status.code(), text(&ctl)),
            "marutop vs maructl {args:?}"
        );
        let err = |o: &Output, prog: &str| String::from_utf8_lossy(&o.stderr).replace(prog, "PROG");
        assert_eq!(err(&top, "marutop"), err(&ctl, "maructl"), "{args:?}");
        (top.status.code(), text(&top))
    };
    let show = both(&["device", "show", dev]);
    assert_eq!(show.0, Some(0));
    assert!(
        show.1.contains("maru device, format version 1"),
        "{}",
        show.1
    );
    let uuid: Value = serde_json::from_str(&both(&["device", "show", dev, "--json"]).1).unwrap();
    // Refused while the daemon holds the device.
    assert_eq!(both(&["device", "clear", dev]).0, Some(9));
    assert_eq!(
        both(&["device", "init", dev, "--force", "--json"]).0,
        Some(9)
    );
    d.stop();
    // A header is there: init without --force is refused, by both, the same way.
    let (code, out) = both(&["device", "init", dev, "--json"]);
    assert_eq!(code, Some(6));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["error"]["kind"], "exists");
    assert_eq!(both(&["device", "init", dev]).0, Some(6));
    // What marutop writes, both read back.
    let top = |args: &[&str]| {
        let o = run("marutop", args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let init: Value =
        serde_json::from_str(&top(&["device", "init", dev, "--force", "--json"])).unwrap();
    assert_ne!(init["uuid"], uuid["uuid"]);
    let show: Value = serde_json::from_str(&both(&["device", "show", dev, "--json"]).1).unwrap();
    assert_eq!(show, init);
    assert_eq!(top(&["device", "clear", dev]), format!("cleared {dev}\n"));
    assert_eq!(
        both(&["device", "show", dev]).1,
        format!("{dev}: no maru header\n")
    );
    assert!(std::fs::read(dev).unwrap()[..32].iter().all(|b| *b == 0));
    top(&["device", "init", dev]);
    assert_eq!(&std::fs::read(dev).unwrap()[..8], b"MARUDEV\0");
    assert_eq!(both(&["device", "show", "/nonexistent/dev"]).0, Some(3));
    assert_eq!(both(&["device", "frobnicate", dev]).0, Some(2));
}

#[test]
fn marutop_csv_snapshots_from_a_live_daemon() {
    maru_tests::require_root!();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M,name=mem".into()],
        mount: false,
        extra: vec![],
    });
    let h = d.handler();
    h.mkdir("t", 0o755).unwrap();
    h.put("t/k", &pattern(1, 4096)).unwrap();
    let top = |args: &[&str]| {
        let o = Command::new(bin("marutop"))
            .arg("--socket")
            .arg(&d.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let out = top(&["pool", "--csv", "--count", "2", "--interval", "0.2"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(header[..4], ["time", "pool", "kind", "capacity"]);
    let mut times = Vec::new();
    for l in &lines[1..] {
        let f: Vec<&str> = l.split(',').collect();
        assert_eq!(f.len(), header.len(), "{l}");
        times.push(f[0].parse::<f64>().unwrap());
        assert_eq!(f[1], "mem");
        assert_eq!(f[3].parse::<u64>().unwrap(), 64 << 20);
        assert_eq!(f[6].parse::<u64>().unwrap(), 1, "entries");
    }
    assert!(times[1] > times[0]);
    // The other views print parseable CSV too (stdout is not a terminal here).
    let stats = top(&["stats", "--count", "1"]);
    assert!(stats.lines().any(|l| l.contains(",publish,")), "{stats}");
    let usage = top(&["usage", "--csv", "--count", "1"]);
    assert!(
        usage.lines().any(|l| l.contains(",namespace,t,")),
        "{usage}"
    );
    // A stopped daemon is a clear error.
    let o = Command::new(bin("marutop"))
        .args(["--socket", "/nonexistent.sock", "--csv", "--count", "1"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot reach marud"));
}

#[test]
fn benchmarks_run_and_write_json() {
    maru_tests::require_root!();
    let dir = tempfile::tempdir().unwrap();
    for (which, rounds) in [("core", "3"), ("fs", "2")] {
        let out_json = dir.path().join(format!("{which}.json"));
        let o = Command::new(bin("maructl"))
            .args(["bench", which, "--rounds", rounds, "--out-json"])
            .arg(&out_json)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "bench {which}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = String::from_utf8(o.stdout).unwrap();
        assert!(text.contains("## Targets"), "{text}");
        let rows: Value = serde_json::from_slice(&std::fs::read(&out_json).unwrap()).unwrap();
        assert!(rows.as_array().unwrap().len() > 10);
    }
}
