//! The Prometheus endpoint after some operations: counters match, the text parses.

use std::collections::BTreeMap;
use std::process::Command;

use maru_tests::{Daemon, Opts, pattern};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A strict reader of the Prometheus text format: every sample line is `name{labels} value`,
/// every metric has HELP and TYPE before its samples. Returns `name{labels}` -> value.
fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut typed = std::collections::HashSet::new();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let name = it.next().unwrap();
            let kind = it.next().unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_owned());
            continue;
        }
        if line.starts_with("# HELP ") || line.is_empty() {
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment: {line}");
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line: {line}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value: {line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad name: {line}"
        );
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| typed.contains(*b)))
            .unwrap_or(name);
        assert!(typed.contains(base), "sample before its TYPE: {line}");
        if let Some(labels) = series.strip_prefix(name)
            && !labels.is_empty()
        {
            assert!(
                labels.starts_with('{') && labels.ends_with('}'),
                "bad labels: {line}"
            );
            for kv in labels[1..labels.len() - 1].split("\",") {
                let (k, v) = kv
                    .split_once("=\"")
                    .unwrap_or_else(|| panic!("bad label: {line}"));
                assert!(k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
                assert!(!v.trim_end_matches('"').contains('"'));
            }
        }
        out.insert(series.to_owned(), v);
    }
    out
}

#[test]
fn metrics_count_what_was_done() {
    maru_tests::require_root!();
    let port = free_port();
    let d = Daemon::start(Opts {
        pools: vec!["memfs:{dir}/pool,size=64M,name=mem".into()],
        mount: true,
        extra: vec!["--metrics".into(), format!("127.0.0.1:{port}")],
    });
    let h = d.handler();
    h.mkdir("m", 0o755).unwrap();
    for i in 0..3u64 {
        h.put(&format!("m/k{i}"), &pattern(i, 1000)).unwrap();
    }
    h.trim();
    for _ in 0..2 {
        h.trim();
        h.retrieve("m/k0").unwrap().unwrap();
    }
    h.delete("m/k2").unwrap();
    assert!(h.put("m/k0", b"dup").is_err());
    std::fs::write(d.path("m/viafs"), b"x").unwrap();
    d.published("m/viafs");
    let out = Command::new("curl")
        .args(["-sf", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .unwrap();
    assert!(out.status.success(), "curl failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let m = parse(&text);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no {k} in:\n{text}"));
    assert_eq!(get("maru_ops_total{op=\"publish\"}"), 4.0);
    // A root client opens memfs entries itself: marud learns of both retrievals from one
    // report, carried by the client's next request (the delete), and counts their bytes.
    assert!(!m.contains_key("maru_ops_total{op=\"retrieve\"}"), "{text}");
    assert_eq!(get("maru_ops_total{op=\"accessed\"}"), 1.0);
    assert_eq!(get("maru_ops_total{op=\"delete\"}"), 1.0);
    assert_eq!(get("maru_errors_total"), 1.0);
    assert_eq!(get("maru_bytes_total{kind=\"stored\"}"), 3000.0 + 1.0);
    assert_eq!(get("maru_bytes_total{kind=\"retrieved\"}"), 2000.0);
    assert_eq!(get("maru_bytes_total{kind=\"deleted\"}"), 1000.0);
    assert_eq!(get("maru_pool_entries{pool=\"mem\",kind=\"memfs\"}"), 3.0);
    assert_eq!(
        get("maru_pool_capacity_bytes{pool=\"mem\",kind=\"memfs\"}"),
        (64u64 << 20) as f64
    );
    assert_eq!(get("maru_op_latency_seconds_count{op=\"publish\"}"), 4.0);
    assert_eq!(
        get("maru_op_latency_seconds_bucket{op=\"publish\",le=\"+Inf\"}"),
        4.0
    );
    assert!(get("maru_fuse_upcalls_total{op=\"create\"}") >= 1.0);
    assert_eq!(get("maru_clients"), 1.0);
    // Anything else is a 404.
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://127.0.0.1:{port}/nope"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"404");
}
