//! Hosts cut off from etcd: three members, each in a network namespace of its own joined to a
//! hub namespace (where etcd runs) by a veth pair; one host's link is taken down and brought
//! back (maru_cluster::testing).

use std::time::{Duration, Instant};

use maru_cluster::testing::{Etcd, EtcdCluster, Net};
use maru_cluster::{EntryRecord, Error, Member, NodeInfo, Published, UNIT};

const POOL: &str = "5f0c1d2e-0000-4000-8000-0000000c0ffe";
const TTL: Duration = Duration::from_secs(2);

fn record(offset: u64) -> EntryRecord {
    EntryRecord {
        offset,
        len: 4096,
        node: "a".into(),
        alloc: offset,
    }
}

/// Runs `f` on host runtime `rt` (its sockets in that host's namespace) and waits.
fn on<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    rt.block_on(rt.spawn(f)).expect("the host task panicked")
}

/// `n` hosts, each in a network namespace of its own, and etcd in the hub; a runtime for each
/// host (its sockets in its namespace). None when namespaces or etcd cannot be had.
fn hosts(n: usize) -> Option<(Net, Etcd, Vec<tokio::runtime::Runtime>)> {
    let net = Net::new(n)?;
    let etcd = Etcd::start_at(Some(&net.hub), &net.hub_ip(), 2379, 2380)?;
    let rts = (0..n).map(|i| net.runtime(i)).collect();
    Some((net, etcd, rts))
}

/// Joins host `i` as `name`, on its runtime `rt`.
fn join(rt: &tokio::runtime::Runtime, eps: &[String], i: usize, name: &str) -> Member {
    let (eps, name) = (eps.to_vec(), name.to_owned());
    on(rt, async move {
        let info = NodeInfo {
            node: name,
            address: format!("host {i}"),
            pid: std::process::id(),
        };
        Member::join(&eps, POOL, info, TTL).await.expect("join")
    })
}

#[test]
fn a_host_cut_off_loses_its_claims_and_owns_nothing_twice_after() {
    let Some((net, etcd, rts)) = hosts(3) else {
        return;
    };
    let eps = etcd.endpoints();
    let join = |i: usize, name: &str| join(&rts[i], &eps, i, name);
    let a = std::sync::Arc::new(tokio::sync::Mutex::new(join(0, "a")));
    let b = std::sync::Arc::new(join(1, "b"));
    let c = std::sync::Arc::new(join(2, "c"));

    // a claims four regions and publishes five entries.
    let a2 = a.clone();
    on(&rts[0], async move {
        let a = a2.lock().await;
        assert!(a.claim(0, 4 * UNIT).await.expect("claim").is_some());
        for i in 0..5u64 {
            let r = a.publish("ns", &format!("e{i}"), &record(i << 12)).await;
            assert!(matches!(r, Ok(Published::New { .. })), "{r:?}");
        }
    });
    let b2 = b.clone();
    assert!(!on(&rts[1], async move {
        b2.claim(UNIT, UNIT).await.expect("claim").is_some()
    }));

    // a is cut off: b takes over its regions once a's lease has run out.
    net.link(0, false);
    let t0 = Instant::now();
    let b2 = b.clone();
    let took = on(&rts[1], async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if b2.claim(UNIT, UNIT).await.expect("claim").is_some() {
                return Instant::now();
            }
            assert!(Instant::now() < deadline, "a's claims outlived its lease");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    eprintln!("b took a's region {:?} after the cut", took - t0);
    // a, cut off, publishes nothing and learns it lost its lease.
    let a2 = a.clone();
    on(&rts[0], async move {
        let a = a2.lock().await;
        let r = a.publish("ns", "while-cut", &record(99 << 12)).await;
        assert!(r.is_err(), "a published while cut off: {r:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while a.is_live() {
            assert!(Instant::now() < deadline, "a still believes it is live");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // The link returns: a's old lease is refused in etcd itself until it rejoins, and then
    // the regions b took stay b's.
    net.link(0, true);
    let a2 = a.clone();
    on(&rts[0], async move {
        let mut a = a2.lock().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match a.publish("ns", "after", &record(100 << 12)).await {
                Err(Error::LeaseLost(_)) => break,
                Err(Error::Etcd(_)) => {} // reconnecting
                other => panic!("a published on a lost lease: {other:?}"),
            }
            assert!(
                Instant::now() < deadline,
                "etcd unreachable after the link came back"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        a.rejoin().await.expect("rejoin");
        assert!(
            a.claim(UNIT, UNIT).await.expect("claim").is_none(),
            "region 1 owned twice"
        );
        assert!(
            a.claim(0, UNIT).await.expect("claim").is_some(),
            "a could not take back a free region"
        );
        assert!(matches!(
            a.publish("ns", "after", &record(100 << 12)).await,
            Ok(Published::New { .. })
        ));
    });

    // Nothing sealed was lost; each region has one holder.
    let c2 = c.clone();
    let (names, regions) = on(&rts[2], async move {
        let all = c2.snapshot().await.expect("snapshot").entries;
        let mut names: Vec<String> = all.into_iter().map(|l| l.name).collect();
        names.sort();
        (names, c2.regions().await.expect("regions"))
    });
    assert_eq!(names, ["after", "e0", "e1", "e2", "e3", "e4"]);
    assert_eq!(regions.get(&0).map(String::as_str), Some("a"));
    assert_eq!(regions.get(&1).map(String::as_str), Some("b"));
    drop(rts);
}

/// etcd's late release of an expired lease (its lessor, busy, retries a revocation 3 s
/// later: doc/RELIABILITY.md) stood in for by a lease kept alive from elsewhere once its
/// host is cut off: the other hosts see its beats stop and end it themselves.
#[test]
fn a_host_cut_off_whose_lease_etcd_keeps_is_ended_by_the_others() {
    let Some((net, etcd, rts)) = hosts(2) else {
        return;
    };
    let eps = etcd.endpoints();
    let join = |i: usize, name: &str| join(&rts[i], &eps, i, name);
    let a = std::sync::Arc::new(tokio::sync::Mutex::new(join(0, "a")));
    let b = std::sync::Arc::new(join(1, "b"));
    let a2 = a.clone();
    let lease = on(&rts[0], async move {
        let a = a2.lock().await;
        assert!(a.claim(0, UNIT).await.expect("claim").is_some());
        a.lease()
    });
    // Beating hosts are left alone: after three TTLs a still holds its region.
    std::thread::sleep(3 * TTL);
    let b2 = b.clone();
    assert!(!on(&rts[1], async move {
        b2.claim(0, UNIT).await.expect("claim").is_some()
    }));
    assert!(on(&rts[0], {
        let a = a.clone();
        async move { a.lock().await.is_live() }
    }));

    // From b's side of the cut, a's lease is renewed as etcd would keep it.
    let eps2 = eps.clone();
    let keeper = rts[1].spawn(async move {
        let c = maru_cluster::etcd::Client::connect(&eps2, Default::default()).expect("connect");
        let mut k = c.lease_keep_alive(lease).await.expect("keep-alive");
        let mut renewals = 0;
        while matches!(k.renew().await, Ok((ttl, _)) if ttl > 0) {
            renewals += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        renewals
    });
    net.link(0, false);
    let t0 = Instant::now();
    // Until when a's clients may write what they were granted (its validity, then the guard).
    let held = on(&rts[0], {
        let a = a.clone();
        async move {
            let a = a.lock().await;
            a.validity().load(std::sync::atomic::Ordering::Acquire)
        }
    });
    assert!(held > 0, "a was not valid at the cut");
    let b2 = b.clone();
    let (took, at) = on(&rts[1], async move {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if b2.claim(0, UNIT).await.expect("claim").is_some() {
                return (Instant::now(), maru_cluster::boottime_ns());
            }
            assert!(
                Instant::now() < deadline,
                "a's lease outlived its beats by 15 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    eprintln!("b took a's region {:?} after the cut", took - t0);
    // Not before a's clients were done: its last validity and the guard (a third of the TTL).
    let guard = TTL.as_nanos() as u64 / 3;
    assert!(
        at >= held + guard,
        "b took the region {} ns before a's clients were done",
        held + guard - at
    );
    let renewals = rts[1].block_on(keeper).expect("keeper");
    assert!(renewals > 1, "the lease was not kept alive ({renewals})");

    // a learns that its lease is gone, and joins anew once the link is back.
    net.link(0, true);
    let a2 = a.clone();
    on(&rts[0], async move {
        let mut a = a2.lock().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while a.is_live() {
            assert!(Instant::now() < deadline, "a still believes it is live");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            a.rejoin().await.expect("rejoin"),
            maru_cluster::Rejoined::Anew
        );
        assert_ne!(a.lease(), lease);
        assert!(
            a.claim(0, UNIT).await.expect("claim").is_none(),
            "region 0 owned twice"
        );
        assert!(a.claim(UNIT, UNIT).await.expect("claim").is_some());
    });
    drop(rts);
}

/// Cuts etcd member `m` from the other two (a minority of one), or joins it again.
fn split(net: &Net, m: usize, cut: bool) {
    for o in (0..3).filter(|&o| o != m) {
        net.block(&net.members[m], &net.member_ip(o), cut);
        net.block(&net.members[o], &net.member_ip(m), cut);
    }
}

#[test]
fn a_member_cut_from_its_quorum_costs_no_request_and_no_lease() {
    let Some(net) = Net::with_members(1, 3) else {
        return;
    };
    let places: Vec<_> = (0..3).map(|m| net.member_place(m)).collect();
    let Some(etcd) = EtcdCluster::start(Some(&net.hub), &places, 2379) else {
        return;
    };
    // A follower is cut off (a leader cut off goes on as one for a while, and what it is
    // asked in the meantime waits); it comes first in the host's list, where the lease's
    // renewals start.
    let leader = etcd.leader(0).expect("m0's status").leader;
    let m = (0..3)
        .find(|&i| etcd.leader(i).is_some_and(|s| s.id != leader))
        .expect("a follower");
    let mut eps = etcd.endpoints();
    eps.swap(0, m);
    let rt = net.runtime(0);
    let a = std::sync::Arc::new(on(&rt, async move {
        let info = NodeInfo {
            node: "a".into(),
            address: "host 0".into(),
            pid: std::process::id(),
        };
        Member::join(&eps, POOL, info, TTL).await.expect("join")
    }));
    let lease = a.lease();
    let a2 = a.clone();
    assert!(on(&rt, async move {
        a2.claim(0, 4 * UNIT).await.expect("claim").is_some()
    }));
    // It knows it has no leader once an election timeout passed.
    split(&net, m, true);
    let deadline = Instant::now() + Duration::from_secs(15);
    while etcd.leader(m).is_some_and(|s| s.leader != 0) {
        assert!(
            Instant::now() < deadline,
            "the member cut off still follows a leader"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Every request lands (those the cut member refuses go to another), for three TTLs;
    // the lease lives on, renewed by the members with a quorum.
    let a2 = a.clone();
    let failed = on(&rt, async move {
        let mut failed = Vec::new();
        let t = Instant::now();
        let mut i = 0u64;
        while t.elapsed() < 3 * TTL {
            if let Err(e) = a2.publish("ns", &format!("q{i}"), &record(i << 12)).await {
                failed.push(e.to_string());
            }
            i += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        failed
    });
    split(&net, m, false);
    assert!(
        failed.is_empty(),
        "{} requests failed, the first: {:?}",
        failed.len(),
        failed.first()
    );
    assert!(a.is_live(), "the lease was lost");
    assert_eq!(a.lease(), lease);
}
