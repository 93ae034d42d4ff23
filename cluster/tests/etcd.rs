//! The cluster metadata against a real etcd (Debian's `etcd-server`), started per test on
//! loopback ports with a private data directory (maru_cluster::testing).

use std::time::{Duration, Instant};

use maru_cluster::testing::{Etcd, EtcdCluster};
use maru_cluster::{
    EntryAt, EntryEvent, EntryRecord, Error, Member, NodeInfo, Publication, Published, Removed,
    Removing, UNIT,
};

const POOL: &str = "5f0c1d2e-0000-4000-8000-00000000c1a5";

/// The next `n` changes a watch reports (10 s at most each).
macro_rules! next_changes {
    ($watch:expr, $n:expr) => {{
        let mut seen = Vec::new();
        for _ in 0..$n {
            seen.push(
                tokio::time::timeout(Duration::from_secs(10), $watch.next())
                    .await
                    .expect("the watch stalled")
                    .expect("watch")
                    .expect("the watch ended"),
            );
        }
        seen
    }};
}

async fn member(etcd: &Etcd, node: &str, ttl_s: u64) -> Member {
    member_at(&etcd.endpoints(), node, ttl_s).await
}

/// [`member`], reaching etcd at `endpoints`.
async fn member_at(endpoints: &[String], node: &str, ttl_s: u64) -> Member {
    Member::join(
        endpoints,
        POOL,
        NodeInfo {
            node: node.into(),
            address: "127.0.0.1".into(),
            pid: std::process::id(),
        },
        Duration::from_secs(ttl_s),
    )
    .await
    .expect("join")
}

/// Publications of `names` in namespace `ns`, one record each, none reserved.
fn publications<'a>(names: &'a [String], recs: &'a [EntryRecord]) -> Vec<Publication<'a>> {
    names
        .iter()
        .zip(recs)
        .map(|(name, record)| Publication {
            ns: "ns",
            name,
            record,
            reserved: false,
        })
        .collect()
}

fn record(node: &str, offset: u64) -> EntryRecord {
    EntryRecord {
        offset,
        len: 4096,
        node: node.into(),
        alloc: offset / 4096,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_publishing_one_key_at_once_one_wins() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, 40 * UNIT).await.expect("claim").is_some());
    assert!(
        b.claim(100 * UNIT, 40 * UNIT)
            .await
            .expect("claim")
            .is_some()
    );
    for round in 0..40u64 {
        let name = format!("k{round}");
        let (rec_a, rec_b) = (record("a", round * UNIT), record("b", (100 + round) * UNIT));
        let (ra, rb) = tokio::join!(
            a.publish("ns", &name, &rec_a),
            b.publish("ns", &name, &rec_b),
        );
        let (ra, rb) = (ra.expect("a"), rb.expect("b"));
        match (&ra, &rb) {
            (Published::New { .. }, Published::Exists { record: w, .. }) => assert_eq!(w.node, "a"),
            (Published::Exists { record: w, .. }, Published::New { .. }) => assert_eq!(w.node, "b"),
            other => panic!("round {round}: not exactly one winner: {other:?}"),
        }
    }
    let all = a.snapshot().await.expect("snapshot").entries;
    assert_eq!(all.len(), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_publications_commits_together_and_each_has_its_own_outcome() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, 4 * UNIT).await.expect("claim").is_some());
    assert!(b.claim(8 * UNIT, UNIT).await.expect("claim").is_some());
    // Taken beforehand: one name published by b, one reserved by b, one reserved by a.
    b.publish("ns", "k7", &record("b", 8 * UNIT))
        .await
        .expect("publish");
    assert_eq!(b.reserve("ns", "k9").await.expect("reserve"), None);
    assert_eq!(a.reserve("ns", "k11").await.expect("reserve"), None);
    // 150 entries (more than one transaction holds), one of them twice, one outside a's
    // regions, one with a bad name.
    let n = 150u64;
    let names: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    let recs: Vec<EntryRecord> = (0..n).map(|i| record("a", i * 4096)).collect();
    let outside = record("a", 8 * UNIT + 4096);
    let mut items: Vec<Publication<'_>> = names
        .iter()
        .zip(&recs)
        .map(|(name, record)| Publication {
            ns: "ns",
            name,
            record,
            reserved: name == "k11",
        })
        .collect();
    items.push(Publication {
        ns: "ns",
        name: "k3",
        record: &recs[4],
        reserved: false,
    });
    items.push(Publication {
        ns: "ns",
        name: "a/b",
        record: &recs[5],
        reserved: false,
    });
    let out = a.publish_many(&items).await;
    assert_eq!(out.len(), items.len());
    for (i, r) in out.iter().enumerate().take(n as usize) {
        match (i, r) {
            (7, Ok(Published::Exists { record: r, .. })) => assert_eq!(r.node, "b"),
            (9, Ok(Published::Reserved(h))) => assert_eq!(h, "b"),
            (_, Ok(Published::New { .. })) if i != 7 && i != 9 => {}
            other => panic!("item {i}: {other:?}"),
        }
    }
    assert!(
        matches!(&out[n as usize], Ok(Published::Exists { record: r, .. }) if r.offset == 3 * 4096),
        "the second publication of k3 finds the first: {:?}",
        out[n as usize]
    );
    // Committed together: one revision per transaction, except in the transaction of the
    // taken names, which each of its items retried alone.
    let revisions: std::collections::HashSet<i64> = out
        .iter()
        .filter_map(|r| match r {
            Ok(Published::New { revision }) => Some(*revision),
            _ => None,
        })
        .collect();
    assert!(revisions.len() < 60, "{} revisions", revisions.len());
    assert!(matches!(out[n as usize + 1], Err(Error::InvalidName(_))));
    let far = Publication {
        ns: "ns",
        name: "far",
        record: &outside,
        reserved: false,
    };
    let near = Publication {
        name: "near",
        record: &recs[149],
        ..far
    };
    let out = a.publish_many(&[far, near]).await;
    assert!(matches!(out[0], Err(Error::NotClaimed { .. })), "{out:?}");
    assert!(matches!(out[1], Ok(Published::New { .. })), "{out:?}");
    let all = b.snapshot().await.expect("snapshot").entries;
    assert_eq!(all.len(), n as usize, "every free name, b's k7 and near");
    assert!(all.iter().any(|l| l.name == "k11" && l.record.node == "a"));
    let k11 = all.iter().find(|l| l.name == "k11").expect("k11").revision;
    assert_eq!(
        b.reserve("ns", "k11").await.expect("reserve"),
        Some(Published::Exists {
            record: record("a", 11 * 4096),
            created: k11
        }),
        "a's reservation went with its publication"
    );
    // A host whose lease is gone publishes none of a group.
    maru_cluster::etcd::Client::connect(&etcd.endpoints(), Default::default())
        .expect("connect")
        .lease_revoke(a.lease())
        .await
        .expect("revoke");
    let late: Vec<String> = (0..3).map(|i| format!("late{i}")).collect();
    let items = publications(&late, &recs[140..]);
    for r in a.publish_many(&items).await {
        assert!(matches!(r, Err(Error::LeaseLost(_))), "{r:?}");
    }
    assert_eq!(
        b.snapshot().await.expect("snapshot").entries.len(),
        n as usize
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_naming_an_entry_takes_only_that_one() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    let created = |p: Published| match p {
        Published::New { revision } => revision,
        other => panic!("not published: {other:?}"),
    };
    let old = created(
        a.publish("ns", "x", &record("a", 0))
            .await
            .expect("publish"),
    );
    let y = created(
        a.publish("ns", "y", &record("a", 4096))
            .await
            .expect("publish"),
    );
    // x is removed and published again: a removal of the old one that reaches etcd only now
    // leaves the new one, in a batch with a removal that matches (y) and one of whichever
    // entry is there (z).
    a.remove("ns", "x").await.expect("remove");
    let new = created(
        a.publish("ns", "x", &record("a", 8192))
            .await
            .expect("publish"),
    );
    a.publish("ns", "z", &record("a", 12288))
        .await
        .expect("publish");
    let named = |name, created, offset| Removing {
        ns: "ns",
        name,
        entry: Some(EntryAt {
            created,
            offset,
            len: 4096,
        }),
    };
    let whichever = Removing {
        ns: "ns",
        name: "z",
        entry: None,
    };
    let out = a
        .remove_many(&[named("x", old, 0), named("y", y, 4096), whichever])
        .await;
    let existed: Vec<bool> = out
        .iter()
        .map(|r| r.as_ref().expect("removed").existed)
        .collect();
    assert_eq!(existed, [false, true, true]);
    let all = a.snapshot().await.expect("snapshot").entries;
    let left: Vec<(&str, i64)> = all.iter().map(|l| (l.name.as_str(), l.revision)).collect();
    assert_eq!(left, [("x", new)]);
    // Named as it is, it goes.
    let out = a.remove_many(&[named("x", new, 8192)]).await;
    assert!(out[0].as_ref().expect("removed").existed);
}

/// A release of a region sent before a fence (its answer lost: the network held it) lands
/// only after this host claimed the region again: it deletes nothing, for it compares the
/// fence, where it deleted the new claim, and another host could then claim and carve the
/// region too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_from_before_a_fence_deletes_no_claim_made_after_it() {
    use maru_cluster::etcd::{Client, Options};
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    let late = a.release_requests(0, UNIT).expect("the requests");
    a.fence_publications().await.expect("fence");
    a.release(0, UNIT).await.expect("release");
    assert!(a.regions().await.expect("regions").is_empty());
    assert!(a.claim(0, UNIT).await.expect("claim again").is_some());
    let c = Client::connect(&etcd.endpoints(), Options::default()).expect("client");
    for t in late {
        assert!(!c.txn(t).await.expect("the late release").succeeded());
    }
    let held = a.regions().await.expect("regions");
    assert_eq!(held.get(&0).map(String::as_str), Some("a"), "{held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_from_before_a_fence_cannot_land_and_later_ones_do() {
    use maru_cluster::etcd::{Client, Compare, Op, Options, Range, Txn};
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    let c = Client::connect(&etcd.endpoints(), Options::default()).expect("client");
    let node = format!("/maru/{POOL}/nodes/a");
    let epoch = |r: maru_cluster::etcd::RangeResponse| r.kvs[0].mod_revision;
    let before = epoch(c.get(node.clone(), Range::KEY).await.expect("get"));
    a.fence_publications().await.expect("fence");
    let after = epoch(c.get(node.clone(), Range::KEY).await.expect("get"));
    assert!(after > before, "the node record is written again");
    // A publication a sent before the fence (the network held it) arrives only now: the
    // comparison it carries fails, so it lands nowhere.
    let entry = format!("/maru/{POOL}/entries/ns/late");
    let late = Txn::new()
        .when([Compare::modified(node.clone(), before)])
        .and_then([Op::put(entry.clone(), "{}", 0)]);
    assert!(!c.txn(late).await.expect("txn").succeeded());
    assert!(c.get(entry, Range::KEY).await.expect("get").kvs.is_empty());
    // a's own publications go on, alone and in a batch.
    assert!(matches!(
        a.publish("ns", "x", &record("a", 0))
            .await
            .expect("publish"),
        Published::New { .. }
    ));
    let rec = record("a", 4096);
    let out = a
        .publish_many(&[Publication {
            ns: "ns",
            name: "y",
            record: &rec,
            reserved: false,
        }])
        .await;
    assert!(matches!(out[0], Ok(Published::New { .. })), "{out:?}");
    assert_eq!(
        a.published_as("ns", "y", &rec).await.expect("read"),
        match out[0] {
            Ok(Published::New { revision }) => Some(revision),
            _ => None,
        }
    );
}

/// Fences member `a` (its node record written again under its lease) as etcd applies a fence
/// whose answer `a` never hears of.
async fn fence_unheard_of(etcd: &Etcd, a: &Member) {
    use maru_cluster::etcd::{Client, Op, Options, Txn};
    let c = Client::connect(&etcd.endpoints(), Options::default()).expect("client");
    let node = format!("/maru/{POOL}/nodes/a");
    let info = serde_json::json!({"node": "a", "address": "127.0.0.1", "pid": 1});
    let fence = Txn::new().and_then([Op::put(node, info.to_string(), a.lease())]);
    assert!(c.txn(fence).await.expect("txn").succeeded());
}

/// Seed 211: a fence whose answer was lost (a timeout) landed all the same; every later
/// publication and claim compared the epoch before it, failed, and was tried again, for ever
/// (two marud overflowed their stacks). The write found is taken as the epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_whose_answer_was_lost_does_not_stop_later_publications() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    fence_unheard_of(&etcd, &a).await;
    assert!(matches!(
        a.publish("ns", "x", &record("a", 0))
            .await
            .expect("publish"),
        Published::New { .. }
    ));
    assert!(a.claim(UNIT, UNIT).await.expect("claim").is_some());
    // A claim refused for another reason fails once, as it should.
    let b = member(&etcd, "b", 10).await;
    assert!(b.claim(0, UNIT).await.expect("claim").is_none());
}

/// Seed 2272: a fence landed that this host had not heard of yet (its answer lost, or on its
/// way back to another task: a publication's resolution fences outside the claims' turn),
/// and a release of a region sent then compared the epoch before it. It failed, and was
/// taken for a release of a claim not this host's: the claim stayed in etcd for as long as
/// the host lived, and no host could carve the region. The release reads the node record
/// when it fails and goes again under the fence it finds; a release of another host's claim
/// still deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_fence_not_heard_of_yet_deletes_the_claim() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    fence_unheard_of(&etcd, &a).await;
    a.release(0, UNIT).await.expect("release");
    let held = a.regions().await.expect("regions");
    assert!(held.is_empty(), "a's claim outlived its release: {held:?}");
    // Free for another host, whose claim a's release leaves alone.
    let b = member(&etcd, "b", 10).await;
    assert!(b.claim(0, UNIT).await.expect("claim").is_some());
    a.release(0, UNIT).await.expect("a release of b's claim");
    let held = a.regions().await.expect("regions");
    assert_eq!(held.get(&0).map(String::as_str), Some("b"), "{held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_at_the_connection_is_known_never_sent() {
    use maru_cluster::etcd::{Client, Options, Range};
    // A port nothing listens on: the connection is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let c = Client::connect(&[format!("127.0.0.1:{port}")], Options::default()).expect("client");
    let e = c.get("k", Range::KEY).await.expect_err("nothing listens");
    assert!(e.never_sent(), "{e}");
    assert!(Error::Etcd(e).never_sent());
}

/// A member killed (its port refuses every connection) costs no request: the balancer goes
/// on choosing it among the others, and what it could not send there goes to another (seed
/// 2484: a mount writer's publication at its release went to a killed member and failed,
/// and the entry its close had promised was dropped, while two members could take it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_killed_costs_no_request() {
    let Some(mut etcd) = EtcdCluster::on_loopback(3) else {
        return;
    };
    let a = member_at(&etcd.endpoints(), "a", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    let killed = (etcd.leader_member().expect("a leader") + 1) % etcd.len();
    etcd.kill(killed);
    let mut failed = Vec::new();
    for i in 0..60u64 {
        let name = format!("k{i}");
        if let Err(e) = a.publish("ns", &name, &record("a", i * 4096)).await {
            failed.push(e.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 60 publications failed with member m{killed} killed, the first: {:?}",
        failed.len(),
        failed.first()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_name_is_held_while_its_host_lives() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let again = Member::join(
        &etcd.endpoints(),
        POOL,
        NodeInfo {
            node: "a".into(),
            address: "elsewhere".into(),
            pid: 1,
        },
        Duration::from_secs(10),
    )
    .await;
    assert!(matches!(again, Err(Error::NodeTaken(n)) if n == "a"));
    assert_eq!(a.nodes().await.expect("nodes").len(), 1);
    a.leave().await.expect("leave");
    let b = member(&etcd, "a", 10).await; // free again once it left
    assert!(b.is_live());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_exclusive_and_die_with_the_lease() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 2).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, 4 * UNIT).await.expect("claim").is_some());
    // Overlapping a's range: refused, and nothing of it claimed (unit 4 stays free).
    assert!(
        b.claim(3 * UNIT, 2 * UNIT).await.expect("claim").is_none(),
        "a unit held twice"
    );
    assert!(b.claim(4 * UNIT, UNIT).await.expect("claim").is_some());
    // Releasing releases only one's own units.
    b.release(0, 5 * UNIT).await.expect("release");
    assert_eq!(
        b.regions().await.expect("regions").len(),
        4,
        "b released a's units"
    );
    a.release(3 * UNIT, UNIT).await.expect("release");
    assert!(b.claim(3 * UNIT, UNIT).await.expect("claim").is_some());
    // Ranges beyond one transaction's limit: all or nothing too.
    assert!(
        b.claim(100 * UNIT, 300 * UNIT)
            .await
            .expect("claim")
            .is_some()
    );
    assert!(b.claim(750 * UNIT, UNIT).await.expect("claim").is_some());
    // The conflict is in the second transaction: the first one's units are given back.
    assert!(
        a.claim(600 * UNIT, 200 * UNIT)
            .await
            .expect("claim")
            .is_none()
    );
    let held = b.regions().await.expect("regions");
    assert_eq!(held.len(), 3 + 1 + 300 + 1); // a: 0..3; b: 3, 100..400, 750
    assert_eq!(held.get(&2).map(String::as_str), Some("a"));
    assert_eq!(held.get(&3).map(String::as_str), Some("b"));
    assert_eq!(
        held.range(600..800).count(),
        1,
        "a kept part of a refused range"
    );
    assert!(matches!(
        b.claim(UNIT + 1, UNIT).await,
        Err(Error::Misaligned { offset, len }) if (offset, len) == (UNIT + 1, UNIT)
    ));
    // a dies without leaving: its keep-alive stops, its lease runs out after 2 s.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.claim(2 * UNIT, UNIT).await.expect("claim").is_none() {
        assert!(Instant::now() < deadline, "a's claim outlived its lease");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        b.nodes()
            .await
            .expect("nodes")
            .iter()
            .all(|n| n.node == "b")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_lost_its_lease_publishes_nothing_until_it_rejoins() {
    let Some(etcd) = Etcd::start() else { return };
    let mut a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    // Only into units it holds.
    assert!(matches!(
        a.publish("ns", "elsewhere", &record("a", 5 * UNIT)).await,
        Err(Error::NotClaimed { .. })
    ));
    assert!(matches!(
        a.publish("ns", "before", &record("a", 0)).await,
        Ok(Published::New { .. })
    ));
    // The lease goes as if a had been cut off for its TTL.
    maru_cluster::etcd::Client::connect(&etcd.endpoints(), Default::default())
        .expect("connect")
        .lease_revoke(a.lease())
        .await
        .expect("revoke");
    let r = a.publish("ns", "after", &record("a", 4096)).await;
    assert!(matches!(r, Err(Error::LeaseLost(_))), "{r:?}");
    assert!(matches!(
        a.claim(9 * UNIT, UNIT).await,
        Err(Error::LeaseLost(_))
    ));
    assert!(!a.is_live());
    // Nothing it published before is lost; nothing after was published.
    let all = b.snapshot().await.expect("snapshot").entries;
    let names: Vec<_> = all.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["before"]);
    a.rejoin().await.expect("rejoin");
    assert!(a.is_live());
    assert!(a.claim(0, UNIT).await.expect("claim").is_some()); // the old lease's claims went with it
    assert!(matches!(
        a.publish("ns", "after", &record("a", 4096)).await,
        Ok(Published::New { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_s_claims_and_renewals_come_back_through_its_entry_watch_as_ticks() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 3).await;
    let b = member(&etcd, "b", 3).await;
    let snap = a.snapshot().await.expect("snapshot");
    assert!(snap.fresh_until > maru_cluster::boottime_ns());
    let mut watch = a.watch_entries(snap.revision + 1).await.expect("watch");
    assert!(b.claim(0, UNIT).await.expect("claim").is_some());
    b.publish("ns", "x", &record("b", 0))
        .await
        .expect("publish");
    let claimed = a.claim(UNIT, UNIT).await.expect("claim").expect("claimed");
    let next = async |watch: &mut maru_cluster::EntryWatch| {
        tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("the watch stalled")
            .expect("watch")
            .expect("the watch ended")
    };
    // b's entry comes first: a claimant that has seen its claim's tick knows every entry
    // published before it.
    let mut put = false;
    loop {
        match next(&mut watch).await {
            EntryEvent::Put { name, .. } => put = name == "x",
            EntryEvent::Tick {
                node,
                until,
                revision,
            } if node == "a" && revision == claimed => {
                assert!(
                    put,
                    "the claim's tick came before the entry published before it"
                );
                assert!(until > maru_cluster::boottime_ns());
                break;
            }
            EntryEvent::Tick { revision, .. } => assert!(revision < claimed),
            e => panic!("{e:?}"),
        }
    }
    // Then each renewal of a's lease (a third of its TTL apart), with the validity it earns.
    let before = maru_cluster::boottime_ns();
    loop {
        if let EntryEvent::Tick { node, until, .. } = next(&mut watch).await
            && node == "a"
        {
            assert!(until > before);
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_and_its_watch_miss_nothing() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    for i in 0..50u64 {
        a.publish("team/ns", &format!("e{i}"), &record("a", i << 12))
            .await
            .expect("publish");
    }
    let snap = b.snapshot().await.expect("snapshot");
    let (seen, revision) = (snap.entries, snap.revision);
    assert_eq!(seen.len(), 50);
    assert!(
        seen.iter()
            .all(|l| l.ns == "team/ns" && l.record.node == "a")
    );
    let mut watch = b.watch_entries(revision + 1).await.expect("watch");
    let writer = tokio::spawn(async move {
        let mut stamps = Vec::new();
        for i in 50..150u64 {
            a.publish("team/ns", &format!("e{i}"), &record("a", i << 12))
                .await
                .expect("publish");
            stamps.push(Instant::now());
        }
        let gone = a.remove("team/ns", "e3").await.expect("remove");
        assert!(gone.existed);
        stamps
    });
    let mut got = Vec::new();
    let mut lags = Vec::new();
    let mut deleted = None;
    while deleted.is_none() {
        match tokio::time::timeout(Duration::from_secs(20), watch.next())
            .await
            .expect("the watch stalled")
            .expect("watch")
            .expect("the watch ended")
        {
            EntryEvent::Put { name, record, .. } => {
                assert_eq!(record.node, "a");
                got.push((name, Instant::now()));
            }
            // The hosts' renewals.
            EntryEvent::Tick { node, .. } => assert!(node == "a" || node == "b", "{node}"),
            EntryEvent::Delete {
                name,
                record: removed,
                created,
                ..
            } => {
                // A removal carries what it removed: the record, and its creation.
                assert_eq!(removed, Some(record("a", 3 << 12)));
                assert!(created > 0 && created <= revision, "created at {created}");
                deleted = Some(name);
            }
        }
    }
    let stamps = writer.await.expect("writer");
    assert_eq!(deleted.as_deref(), Some("e3"));
    let expected: Vec<String> = (50..150).map(|i| format!("e{i}")).collect();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expected, "missed or reordered publications");
    for ((_, at), published) in got.iter().zip(&stamps) {
        lags.push(at.saturating_duration_since(*published));
    }
    lags.sort();
    // Reported, not asserted (shared machines are noisy): publication to the watcher.
    eprintln!(
        "watch lag after publish returned: p50 {:?}, p99 {:?}",
        lags[lags.len() / 2],
        lags[lags.len() * 99 / 100]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_extent_is_free_once_every_host_acknowledged_and_none_holds_it() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    assert_eq!(a.acknowledged().await.expect("acks"), None, "alone");
    let b = member(&etcd, "b", 2).await;
    assert!(a.claim(2 * UNIT, 4 * UNIT).await.expect("claim").is_some());
    // A 5 MiB entry across units 2..=4, and a small one in unit 5.
    let big = EntryRecord {
        offset: 2 * UNIT + 4096,
        len: 5 << 20,
        node: "a".into(),
        alloc: 1,
    };
    let small = record("a", 5 * UNIT);
    a.publish("ns", "big", &big).await.expect("publish");
    a.publish("ns", "small", &small).await.expect("publish");
    // b is live and has acknowledged nothing: a waits for it.
    assert_eq!(a.acknowledged().await.expect("acks"), Some(0));
    let seen = b.snapshot().await.expect("snapshot").revision;
    b.acknowledge(seen, &[]).await.expect("acknowledge");
    assert_eq!(a.acknowledged().await.expect("acks"), Some(seen));
    let gone = a.remove("ns", "big").await.expect("remove");
    assert!(gone.existed && gone.revision > seen);
    let gone_too = a.remove("ns", "small").await.expect("remove");
    assert!(gone_too.revision > gone.revision);
    assert!(!a.remove("ns", "small").await.expect("remove").existed);
    // Not yet seen by b.
    assert!(a.acknowledged().await.expect("acks") < Some(gone.revision));
    // A host that missed both removals finds, with the entries, the revision of each.
    let snap = b.snapshot().await.expect("snapshot");
    assert!(snap.entries.is_empty() && snap.revision >= gone_too.revision);
    assert_eq!(snap.removed_at(big.offset, 1), gone.revision);
    assert_eq!(snap.removed_at(small.offset, 1), gone_too.revision);
    // b applies both removals while clients of b map both extents: it holds them, and only
    // then acknowledges.
    b.acknowledge(
        gone_too.revision,
        &[(big.offset, big.len, 2), (small.offset, small.len, 3)],
    )
    .await
    .expect("acknowledge");
    assert_eq!(
        a.acknowledged().await.expect("acks"),
        Some(gone_too.revision)
    );
    assert_eq!(
        a.held(&[big.offset, small.offset, 7 * UNIT])
            .await
            .expect("held"),
        [big.offset, small.offset].into_iter().collect()
    );
    // a lets its region go; while b maps the extent nobody claims its units afresh, but a
    // host recovering its own entries there claims them again.
    a.release(2 * UNIT, 4 * UNIT).await.expect("release");
    assert!(b.claim(4 * UNIT, UNIT).await.expect("claim").is_none());
    assert!(b.claim(0, 3 * UNIT).await.expect("claim").is_none());
    assert!(b.claim(6 * UNIT, UNIT).await.expect("claim").is_some());
    assert!(a.claim_again(5 * UNIT, UNIT).await.expect("claim again"));
    b.unhold(big.offset, big.len, 2).await.expect("unhold");
    assert_eq!(
        a.held(&[big.offset]).await.expect("held"),
        Default::default()
    );
    // a's removals leave tombstones until every live host, a too, acknowledged them.
    assert!(b.claim(2 * UNIT, 3 * UNIT).await.expect("claim").is_none());
    assert_eq!(a.sweep().await.expect("sweep"), 4, "a has not acknowledged");
    a.acknowledge(gone_too.revision, &[])
        .await
        .expect("acknowledge");
    assert_eq!(a.sweep().await.expect("sweep"), 0);
    // Swept: every live host acknowledged it, so any revision after the entry's creation will do.
    let snap = b.snapshot().await.expect("snapshot");
    assert!(snap.removals.is_empty());
    assert_eq!(snap.removed_at(big.offset, 9), 10);
    assert!(b.claim(2 * UNIT, 3 * UNIT).await.expect("claim").is_some());
    // A host's holds and acknowledgement go with its lease.
    drop(b);
    let t = Instant::now();
    while !a.held(&[small.offset]).await.expect("held").is_empty()
        || a.acknowledged().await.expect("acks").is_some()
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "b's holds outlived its lease"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Seed 205's finding (doc/RELIABILITY.md): the publisher of a removed entry gone, its
/// units were claimed afresh and written while a host whose view lagged still served the
/// entry there. A removal leaves tombstones that keep its units from a fresh claim until
/// every live host acknowledged it, whoever removed it, whatever became of the publisher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_extent_is_not_claimed_afresh_while_a_live_host_has_not_applied_the_removal() {
    use maru_cluster::etcd::{Client, Options, Range};
    let Some(etcd) = Etcd::start() else { return };
    let raw = Client::connect(&etcd.endpoints(), Options::default()).expect("client");
    let tombstones = || async {
        let prefix = format!("/maru/{POOL}/gone/");
        raw.get(prefix, Range::COUNT_UNDER)
            .await
            .expect("count")
            .count
    };
    let a = member(&etcd, "a", 2).await;
    let b = member(&etcd, "b", 10).await;
    let c = member(&etcd, "c", 10).await;
    // a publishes e (unit 3), f (unit 4) and g (units 10..140, more tombstones than one
    // transaction takes).
    assert!(a.claim(3 * UNIT, 2 * UNIT).await.expect("claim").is_some());
    assert!(
        a.claim(10 * UNIT, 130 * UNIT)
            .await
            .expect("claim")
            .is_some()
    );
    let created = |p: Published| match p {
        Published::New { revision } => revision,
        other => panic!("not published: {other:?}"),
    };
    let e = record("a", 3 * UNIT);
    let f = record("a", 4 * UNIT);
    let g = EntryRecord {
        offset: 10 * UNIT,
        len: 130 * UNIT,
        node: "a".into(),
        alloc: 9,
    };
    let (ce, cf, cg) = (
        created(a.publish("ns", "e", &e).await.expect("publish")),
        created(a.publish("ns", "f", &f).await.expect("publish")),
        created(a.publish("ns", "g", &g).await.expect("publish")),
    );
    let seen = b.snapshot().await.expect("snapshot").revision;
    for m in [&a, &b, &c] {
        m.acknowledge(seen, &[]).await.expect("acknowledge");
    }
    // b removes e and g; c removes f.
    let gone = b
        .remove_many(&[
            Removing {
                ns: "ns",
                name: "e",
                entry: Some(EntryAt::of(ce, &e)),
            },
            Removing {
                ns: "ns",
                name: "g",
                entry: Some(EntryAt::of(cg, &g)),
            },
        ])
        .await;
    assert!(gone.iter().all(|r| r.as_ref().expect("removed").existed));
    let f_gone = c
        .remove_many(&[Removing {
            ns: "ns",
            name: "f",
            entry: Some(EntryAt::of(cf, &f)),
        }])
        .await
        .pop()
        .expect("one")
        .expect("removed");
    assert!(f_gone.existed);
    let last = f_gone
        .revision
        .max(gone[1].as_ref().expect("removed").revision);
    assert_eq!(tombstones().await, 1 + 130 + 1);
    // a dies: its claims go with its lease.
    drop(a);
    let t = Instant::now();
    while b.regions().await.expect("regions").contains_key(&3) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a's claims outlived its lease"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // b applied every removal; c's view lags: it has applied none of them, and would still
    // serve e, f and g. Nobody carves their units afresh, and b's tombstones stay.
    b.acknowledge(last, &[]).await.expect("acknowledge");
    assert_eq!(b.sweep().await.expect("sweep"), 131);
    for (offset, len) in [(3 * UNIT, UNIT), (4 * UNIT, UNIT), (75 * UNIT, UNIT)] {
        assert!(
            b.claim(offset, len).await.expect("claim").is_none(),
            "{offset:#x}"
        );
    }
    // c catches up, then leaves without sweeping its own: b sweeps them too (c is gone).
    c.acknowledge(last, &[]).await.expect("acknowledge");
    c.leave().await.expect("leave");
    assert_eq!(b.sweep().await.expect("sweep"), 0);
    assert_eq!(tombstones().await, 0);
    assert!(b.claim(3 * UNIT, 2 * UNIT).await.expect("claim").is_some());
    assert!(
        b.claim(10 * UNIT, 130 * UNIT)
            .await
            .expect("claim")
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_hold_for_every_host_and_go_with_their_entry() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    a.publish("ns", "k", &record("a", 4096))
        .await
        .expect("publish");
    assert!(
        b.pin("ns", "absent", true).await.expect("pin").is_none(),
        "pinned what is not there"
    );
    let (none, revision) = a.pins().await.expect("pins");
    assert!(none.is_empty());
    let mut watch = a.watch_pins(revision + 1).await.expect("watch");
    let pinned = b.pin("ns", "k", true).await.expect("pin").expect("pinned");
    assert_eq!(
        a.pins().await.expect("pins").0,
        [("ns".to_owned(), "k".to_owned())]
    );
    let unpinned = b
        .pin("ns", "k", false)
        .await
        .expect("unpin")
        .expect("unpinned");
    let again = b.pin("ns", "k", true).await.expect("pin").expect("pinned");
    let removed = a.remove("ns", "k").await.expect("remove");
    assert!(removed.existed);
    let seen: Vec<(bool, i64)> = next_changes!(watch, 4)
        .into_iter()
        .map(|e| (e.2, e.3))
        .collect();
    assert_eq!(
        seen[..3],
        [(true, pinned), (false, unpinned), (true, again)],
        "pin, unpin, pin, each at the revision its change answered"
    );
    assert!(
        !seen[3].0 && seen[3].1 > again,
        "gone with the entry, after"
    );
    assert!(a.pins().await.expect("pins").0.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_are_one_record_for_every_host() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    let (none, revision) = b.quotas().await.expect("quotas");
    assert!(none.is_empty());
    let mut watch = b.watch_quotas(revision + 1).await.expect("watch");
    let set = a.set_quota("team/x", Some(5 << 20)).await.expect("set");
    let cleared = a.set_quota("team/x", None).await.expect("clear");
    let other = a.set_quota("team", Some(7)).await.expect("set");
    assert!(set < cleared && cleared < other);
    // Clearing what is not set changes nothing: the watch shows no change between `other`
    // and the next (the revision moves on meanwhile: the hosts' beats).
    a.set_quota("team/x", None).await.expect("clear again");
    let last = a.set_quota("team/y", Some(9)).await.expect("set");
    assert_eq!(
        b.quotas().await.expect("quotas").0,
        [("team".to_owned(), 7), ("team/y".to_owned(), 9)]
    );
    let seen = next_changes!(watch, 4);
    assert_eq!(
        seen,
        [
            ("team/x".to_owned(), Some(5 << 20), set),
            ("team/x".to_owned(), None, cleared),
            ("team".to_owned(), Some(7), other),
            ("team/y".to_owned(), Some(9), last),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_name_is_no_one_elses_until_published_or_given_back() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    assert!(b.claim(UNIT, UNIT).await.expect("claim").is_some());
    assert_eq!(a.reserve("ns", "k").await.expect("reserve"), None);
    assert_eq!(
        a.reserve("ns", "k").await.expect("again"),
        None,
        "a keeps its own"
    );
    assert_eq!(
        b.reserve("ns", "k").await.expect("reserve"),
        Some(Published::Reserved("a".into()))
    );
    assert_eq!(
        b.publish("ns", "k", &record("b", UNIT))
            .await
            .expect("publish"),
        Published::Reserved("a".into())
    );
    assert!(matches!(
        a.publish_reserved("ns", "k", &record("a", 4096)).await,
        Ok(Published::New { .. })
    ));
    assert!(matches!(
        b.reserve("ns", "k").await.expect("reserve"),
        Some(Published::Exists { record: r, .. }) if r.node == "a"
    ));
    // Given back, the name is free; a dead host's reservations go with its lease.
    assert_eq!(a.reserve("ns", "k2").await.expect("reserve"), None);
    a.unreserve("ns", "k2").await.expect("unreserve");
    assert_eq!(b.reserve("ns", "k2").await.expect("reserve"), None);
    b.leave().await.expect("leave");
    assert_eq!(a.reserve("ns", "k2").await.expect("reserve"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pins_are_per_host_and_go_with_its_lease() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 2).await;
    let c = member(&etcd, "c", 10).await;
    let (none, revision) = a.client_pins().await.expect("client pins");
    assert!(none.is_empty());
    let mut watch = a.watch_client_pins(revision + 1).await.expect("watch");
    let names = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter()
            .map(|(n, k)| (n.to_string(), k.to_string()))
            .collect()
    };
    b.pin_for_clients(&names(&[("team/ns", "k1"), ("team/ns", "k2")]), true)
        .await
        .expect("pin");
    c.pin_for_clients(&names(&[("team/ns", "k1")]), true)
        .await
        .expect("pin");
    b.pin_for_clients(&names(&[("team/ns", "k2")]), false)
        .await
        .expect("unpin");
    let seen = next_changes!(watch, 4);
    let ev = |k: &str, n: &str, on: bool| ("team/ns".to_owned(), k.to_owned(), n.to_owned(), on);
    assert_eq!(
        seen,
        [
            ev("k1", "b", true),
            ev("k2", "b", true),
            ev("k1", "c", true),
            ev("k2", "b", false)
        ]
    );
    let mut all = a.client_pins().await.expect("client pins").0;
    all.sort();
    let pin = |k: &str, n: &str| ("team/ns".to_owned(), k.to_owned(), n.to_owned());
    assert_eq!(all, [pin("k1", "b"), pin("k1", "c")]);
    // b's pins go with its lease.
    drop(b);
    let t = Instant::now();
    while a.client_pins().await.expect("client pins").0 != [pin("k1", "c")] {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "b's pins outlived it"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_member_keeps_its_lease_for_many_ttls() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 1).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(a.is_live(), "the keep-alive let a 1 s lease run out");
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
}

/// An entry of host a of 300 units of 2 MiB from unit 4: more tombstones than a
/// transaction takes.
fn huge_of_a() -> EntryRecord {
    EntryRecord {
        offset: 4 * UNIT,
        len: 300 * UNIT,
        node: "a".into(),
        alloc: 1,
    }
}

/// An entry whose tombstones do not fit in one transaction (its removal puts them first, in
/// transactions of their own): a host that learns of its removal from a read of every entry
/// waits for the acknowledgement of the removal's own revision, not of its first tombstones'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_entry_read_removed_is_removed_at_its_removals_revision() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    let huge = huge_of_a();
    assert!(
        a.claim(huge.offset, huge.len)
            .await
            .expect("claim")
            .is_some()
    );
    a.publish("ns", "huge", &huge).await.expect("publish");
    let gone = a.remove("ns", "huge").await.expect("remove");
    assert!(gone.existed);
    let snap = b.snapshot().await.expect("snapshot");
    assert!(snap.entries.is_empty());
    assert_eq!(snap.removed_at(huge.offset, 1), gone.revision);
}

/// `m`'s removal of `r` alone, answered.
async fn remove_one(m: &Member, r: Removing<'_>) -> Removed {
    let out = m.remove_many(&[r]).await.pop().expect("one outcome");
    out.expect("the removal answered")
}

/// Two hosts remove one entry at once and `b` goes first: `a`'s removal finds the entry gone
/// and joins `b`'s, at the revision of `b`'s removal (the one hosts acknowledge as they apply
/// it), not at its own transaction's, which no host acknowledges until some later removal:
/// the entry's publisher kept its extent until then. So for an entry whose tombstones go
/// ahead of its removal too; and once the removal's tombstones are swept, at a revision every
/// live host has acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_that_finds_the_entry_removed_joins_the_removal_that_took_it() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    let huge = huge_of_a();
    assert!(a.claim(0, UNIT).await.expect("claim").is_some());
    assert!(
        a.claim(huge.offset, huge.len)
            .await
            .expect("claim")
            .is_some()
    );
    let (small, swept) = (record("a", 4096), record("a", 8192));
    let mut at = std::collections::HashMap::new();
    for (name, rec) in [("small", &small), ("huge", &huge), ("swept", &swept)] {
        let Published::New { revision } = a.publish("ns", name, rec).await.expect("publish") else {
            panic!("{name}: not published");
        };
        at.insert(name, EntryAt::of(revision, rec));
    }
    let named = |name: &'static str| Removing {
        ns: "ns",
        name,
        entry: Some(at[name]),
    };
    for name in ["small", "huge"] {
        let theirs = remove_one(&b, named(name)).await;
        assert!(theirs.existed, "{name}");
        // b acknowledges its removal (a change after it, as renewals and publications make).
        b.acknowledge(theirs.revision, &[])
            .await
            .expect("acknowledge");
        let ours = remove_one(&a, named(name)).await;
        assert!(!ours.existed, "{name}: removed by b already");
        assert_eq!(
            ours.revision, theirs.revision,
            "{name}: a's removal joins b's, which b acknowledged"
        );
    }
    // Every live host acknowledges b's removal, and b sweeps its tombstones.
    let theirs = remove_one(&b, named("swept")).await;
    for m in [&a, &b] {
        m.acknowledge(theirs.revision, &[])
            .await
            .expect("acknowledge");
    }
    let left = b.sweep().await.expect("sweep");
    assert_eq!(left, 0, "every tombstone of b's swept");
    let ours = remove_one(&a, named("swept")).await;
    assert!(!ours.existed);
    assert!(
        ours.revision > at["swept"].created && ours.revision <= theirs.revision,
        "{ours:?}: a revision after the entry's creation that every live host acknowledged"
    );
    let acked = a.acknowledged().await.expect("acknowledgements");
    assert!(acked.is_some_and(|x| x >= ours.revision), "{acked:?}");
}

/// A read of every entry larger than gRPC's usual limit on a message (4 MiB): 20,000 entries
/// with long names, read whole by another host, as a host joining a busy pool does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_every_entry_larger_than_four_mib_comes_whole() {
    let Some(etcd) = Etcd::start() else { return };
    let a = member(&etcd, "a", 10).await;
    let b = member(&etcd, "b", 10).await;
    let n = 20_000u64;
    assert!(
        a.claim(0, (n * 4096).div_ceil(UNIT) * UNIT)
            .await
            .expect("claim")
            .is_some()
    );
    let names: Vec<String> = (0..n)
        .map(|i| format!("llama-3-8b.tp-0.layer-group-{i:06}-{}", "k".repeat(120)))
        .collect();
    let recs: Vec<EntryRecord> = (0..n).map(|i| record("a", i * 4096)).collect();
    for (names, recs) in names.chunks(1000).zip(recs.chunks(1000)) {
        for r in a.publish_many(&publications(names, recs)).await {
            assert!(matches!(r, Ok(Published::New { .. })), "{r:?}");
        }
    }
    let all = b.snapshot().await.expect("a read of every entry").entries;
    assert_eq!(all.len(), n as usize);
}

/// An entry watch goes to the etcd member the lease's renewals go through, not wherever the
/// balancer sends it: with one member stopped (its connections open, nothing answered, as a
/// member behind a partition looks until keep-alive gives up), every watch started delivers
/// what another host publishes. Through the balancer, some went to the stopped member and
/// delivered nothing: a daemon starting a lagging watch again could go back there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_watch_goes_to_the_member_the_lease_is_renewed_through() {
    let Some(etcd) = EtcdCluster::on_loopback(3) else {
        return;
    };
    let all = etcd.endpoints();
    let stopped = (etcd.leader_member().expect("a leader") + 1) % all.len();
    let a = member_at(&all, "a", 2).await;
    let others: Vec<String> = (0..all.len())
        .filter(|&i| i != stopped)
        .map(|i| all[i].clone())
        .collect();
    let b = member_at(&others, "b", 2).await;
    // A member that does not lead stops; a's renewals go on through the others.
    etcd.pause(stopped, true);
    let beaten = a.beaten();
    let since = beaten.load(std::sync::atomic::Ordering::Acquire);
    let t = Instant::now();
    while beaten.load(std::sync::atomic::Ordering::Acquire) <= since {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a's lease is not renewed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..8u64 {
        let name = format!("k{i}");
        assert!(b.claim(i * UNIT, UNIT).await.expect("claim").is_some());
        let published = b.publish("ns", &name, &record("b", i * UNIT)).await;
        let Ok(Published::New { revision }) = published else {
            panic!("{published:?}");
        };
        let delivered = tokio::time::timeout(Duration::from_secs(3), async {
            let mut w = a.watch_entries(revision).await.expect("watch");
            loop {
                match w.next().await.expect("watch").expect("the watch ended") {
                    EntryEvent::Put { name: n, .. } if n == name => break,
                    _ => {}
                }
            }
        })
        .await;
        assert!(
            delivered.is_ok(),
            "watch {i} delivered nothing (member m{stopped} stopped)"
        );
    }
    etcd.pause(stopped, false);
}
