//! The cluster under faults, in CI: short seeded runs of the fault harness
//! (`maru_tests::faults`, run longer by hand with `maru-faults`; doc/RELIABILITY.md,
//! "Cluster faults"), with only the fault kinds that pass reliably. Each run must end with
//! no violation found by the checker.

use std::time::Duration;

use maru_tests::faults::{Config, nemesis::Kind, run};
use maru_tests::require_root;

fn clean(seed: u64, secs: u64, faults: &[Kind]) {
    let cfg = Config {
        seed,
        duration: Duration::from_secs(secs),
        faults: faults.to_vec(),
        ..Config::default()
    };
    let Some(report) = run(&cfg) else { return };
    eprintln!("{report}");
    assert!(report.violations.is_empty(), "{report}");
    assert!(
        report.ops.values().map(|(n, _)| n).sum::<u64>() > 50,
        "{report}"
    );
}

// One test, the runs one after the other: each starts three etcd members and three hosts,
// and the convergence bound is a time.
#[test]
fn seeded_runs_under_faults_find_no_violation() {
    require_root!();
    clean(1, 10, &[]);
    clean(2, 15, &[Kind::Compact]);
    // Pauses longer than the lease: the fencing (doc/CLUSTER.md).
    clean(3, 15, &[Kind::Pause]);
    // Hosts cut off from etcd and the others: the fencing, and the recovery bounds (a cut
    // host acknowledges no store after its TTL; etcd drops its claims within TTL + 1 s).
    clean(5, 15, &[Kind::Partition]);
    // Hosts killed and restarted, and cut off: what a restarted host recovered and another
    // removed while it was cut off goes (seed 18's wrong bytes). etcd-kill passes the seeds
    // doc/RELIABILITY.md lists but has run too few times to gate every change on.
    clean(7, 15, &[Kind::Kill, Kind::Partition]);
}
