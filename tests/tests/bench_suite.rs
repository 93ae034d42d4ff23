//! The benchmark suite's smoke run: `maru-bench --quick` starts its own daemon, mount and
//! Redis, runs every case on small contexts, checks every consumer read the right bytes,
//! writes the table, the JSON and the six charts, and leaves no mount behind.

use std::process::Command;

use maru_tests::bin;
use serde_json::Value;

#[test]
fn quick_run_writes_table_json_and_charts() {
    maru_tests::require_root!();
    let out = tempfile::Builder::new()
        .prefix("maru-bench-out-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let o = Command::new(bin("maru-bench"))
        .args(["--quick", "--out"])
        .arg(out.path())
        .output()
        .expect("running maru-bench");
    assert!(
        o.status.success(),
        "maru-bench --quick failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let md = std::fs::read_to_string(out.path().join("results.md")).expect("results.md");
    for heading in [
        "### Targets",
        "### Context length",
        "### Fan-out",
        "### Churn",
        "### Metadata",
    ] {
        assert!(md.contains(heading), "results.md lacks {heading}");
    }
    let j: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).expect("json"))
            .expect("results.json is JSON");
    // Every system in every context row, with positive times; read-once never before addressable.
    let ctx = j["context"].as_array().expect("context rows");
    for sys in ["maru-fs", "libmaru", "direct", "copy", "tcp", "redis"] {
        let rows: Vec<&Value> = ctx.iter().filter(|r| r["system"] == sys).collect();
        assert_eq!(rows.len(), 2, "{sys}: one row per context length");
        for r in rows {
            let a = r["addressable_ms"]["median"].as_f64().expect("number");
            let ro = r["read_once_ms"]["median"].as_f64().expect("number");
            assert!(
                a > 0.0 && ro >= a,
                "{sys}: addressable {a} ms, read once {ro} ms"
            );
        }
    }
    assert_eq!(
        j["fanout"].as_array().map(Vec::len),
        Some(12),
        "2 consumer counts x 6 systems"
    );
    let churn = j["churn"].as_array().expect("churn rows");
    assert_eq!(churn.len(), 3);
    for c in churn {
        assert!(c["ops_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{c}");
        assert!(
            c["evicted"].as_u64().unwrap_or(0) > 0,
            "eviction was active: {c}"
        );
    }
    assert_eq!(j["metadata"].as_array().map(Vec::len), Some(7));
    assert!(!j["targets"].as_array().expect("targets").is_empty());
    for png in [
        "context_addressable.png",
        "context_read_once.png",
        "fanout_wall.png",
        "fanout_cpu.png",
        "churn.png",
        "metadata.png",
    ] {
        let b = std::fs::read(out.path().join(png)).unwrap_or_else(|e| panic!("{png}: {e}"));
        assert!(b.starts_with(b"\x89PNG\r\n\x1a\n"), "{png} is not a PNG");
        assert!(
            b.len() > 10_000,
            "{png} is nearly empty ({} bytes)",
            b.len()
        );
    }
    // Nothing of the run is left mounted.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    assert!(
        !mounts.lines().any(|l| l.contains("/tmp/maru-bench-")),
        "maru-bench left a mount:\n{mounts}"
    );
}
