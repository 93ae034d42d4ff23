//! What this host's entry watch has shown it of the shared pool, and how fresh that is.
//!
//! A host serves entries, and carves regions, from its view of etcd: a read of every entry,
//! then the watch. A watch can lag by seconds without breaking (its etcd member cut off from
//! the others, the connection not yet found dead), and then the host would serve an entry
//! removed elsewhere (seed 1495) or carve a region whose last holder published an entry
//! there it has not seen (seed 1462). Two things bound that:
//!
//! - **Freshness.** Each renewal of the lease writes the host's tick with the validity the
//!   renewal earns (`maru_cluster::EntryEvent::Tick`), which the entry watch carries back:
//!   once it has, the view holds every change made before the renewal was asked. The host
//!   counts a renewal's validity only from then on ([`View::valid`], the fence's other
//!   half), so a host whose view is older than the guard allows is fenced off as one whose
//!   lease is in doubt.
//! - **Claims.** A claim writes the tick too, at its own revision: the host waits until its
//!   watch has delivered that revision ([`View::wait_seen`]); every entry published in the
//!   range before its last holder lost it is then in [`View::others`], and one there makes
//!   the claim refused. A read of every entry marks lost any region of this host's where
//!   another host's entry lives (one claimed again after a rejoin, which another host took,
//!   wrote and lost meanwhile): nothing more is placed there, nothing written there
//!   published.
//!
//! A watch that has not delivered the host's last beat a renewal's period after it was
//! written ([`Lag`]) is started again.
//!
//! An entry an earlier run of this node published and this run did not recover (etcd took
//! the publication, the run was killed before its store recorded it) counts as another
//! host's ([`View::own`]): its bytes live in a region this run does not hold, and are
//! served by every host (seed 1591: a restarted host claimed that region as empty, and
//! wrote over such an entry that other hosts were serving).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use maru_cluster::{EntryEvent, EntryRecord, Snapshot};

use parking_lot::Mutex;

use crate::store::SharedId;

/// This host's view of the entries: how fresh, how far, and the other hosts' extents.
pub(super) struct View {
    node: String,
    /// The revision of this host's last beat (`maru_cluster::Member::beaten`), which wrote
    /// its tick too.
    beaten: Arc<AtomicI64>,
    /// Until when the view is fresh enough to serve from (CLOCK_BOOTTIME, ns): the validity
    /// of this host's newest tick the watch delivered, or of the newest read of every entry
    /// applied.
    valid: AtomicU64,
    /// The revision up to which the watch has delivered every change.
    seen: tokio::sync::watch::Sender<i64>,
    /// The entries not this run's ([`View::own`]) as the watch delivered them, ahead of the
    /// store (which may hold a change back while this host changes the name): by extent
    /// offset, its length and the entry's creation revision.
    others: Mutex<BTreeMap<u64, (u64, i64)>>,
    /// From which revision this node's entries are this run's, and those of earlier runs
    /// this run recovered ([`View::this_run`]).
    run: OnceLock<(i64, HashSet<SharedId>)>,
    /// The seam that holds the watch's changes back, as a watch stuck on a member cut off
    /// from the others would (tests; feature `seams`).
    #[cfg(feature = "seams")]
    held: tokio::sync::watch::Sender<bool>,
}

impl View {
    pub(super) fn new(node: &str, beaten: Arc<AtomicI64>) -> Self {
        View {
            node: node.to_owned(),
            beaten,
            valid: AtomicU64::new(0),
            seen: tokio::sync::watch::Sender::new(0),
            others: Mutex::new(BTreeMap::new()),
            run: OnceLock::new(),
            #[cfg(feature = "seams")]
            held: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Waits while the seam holds the watch's changes back (tests).
    #[cfg(feature = "seams")]
    pub(super) async fn gate(&self) {
        let _ = self.held.subscribe().wait_for(|held| !held).await;
    }

    /// No seam: built with feature `seams` only.
    #[cfg(not(feature = "seams"))]
    pub(super) async fn gate(&self) {}

    /// Holds back (or lets go of) what the watch delivers (tests).
    #[cfg(feature = "seams")]
    pub(super) fn hold(&self, held: bool) {
        self.held.send_replace(held);
    }

    /// This run's entries are this node's created from revision `from` on (the node record
    /// this run last wrote before its applier started: an earlier run's publications compared
    /// that run's own record, and none landed after this run's first), and those created
    /// before it that the store recovered or this run published while recovering, `recovered`.
    /// Set once, after the store's recovery and before the first read of every entry.
    pub(super) fn this_run(&self, from: i64, recovered: HashSet<SharedId>) {
        let _ = self.run.set((from, recovered));
    }

    /// Whether entry `record`, created at revision `created`, is this run's own: this
    /// node's, and not one an earlier run published that this run did not recover (one
    /// transaction publishes several entries at one revision: each is told by its offset too).
    pub(super) fn own(&self, record: &EntryRecord, created: i64) -> bool {
        let at = SharedId {
            created,
            offset: record.offset,
        };
        record.node == self.node
            && self
                .run
                .get()
                .is_none_or(|(from, recovered)| created >= *from || recovered.contains(&at))
    }

    /// Until when the view is fresh enough to serve from (0: not yet).
    pub(super) fn valid(&self) -> u64 {
        self.valid.load(Ordering::Acquire)
    }

    /// A read of every entry, about to be applied: the other hosts' extents are its own,
    /// and the watch has delivered everything up to it.
    pub(super) fn read(&self, snap: &Snapshot) {
        let mut others = self.others.lock();
        others.clear();
        for l in snap
            .entries
            .iter()
            .filter(|l| !self.own(&l.record, l.revision))
        {
            others.insert(l.record.offset, (l.record.len, l.revision));
        }
        drop(others);
        self.seen_up_to(snap.revision);
    }

    /// The read of every entry at `snap` is applied: the view is as fresh as it.
    pub(super) fn applied(&self, fresh_until: u64) {
        self.valid.fetch_max(fresh_until, Ordering::AcqRel);
    }

    /// The watch delivered `ev`.
    pub(super) fn event(&self, ev: &EntryEvent) {
        match ev {
            EntryEvent::Put {
                record, revision, ..
            } => {
                if !self.own(record, *revision) {
                    self.others
                        .lock()
                        .insert(record.offset, (record.len, *revision));
                }
                self.seen_up_to(*revision);
            }
            EntryEvent::Delete {
                revision,
                created,
                record,
                ..
            } => {
                if let Some(r) = record {
                    let mut others = self.others.lock();
                    if others.get(&r.offset).is_some_and(|&(_, c)| c == *created) {
                        others.remove(&r.offset);
                    }
                }
                self.seen_up_to(*revision);
            }
            EntryEvent::Tick {
                node,
                until,
                revision,
            } => {
                if *node == self.node {
                    self.valid.fetch_max(*until, Ordering::AcqRel);
                }
                self.seen_up_to(*revision);
            }
        }
    }

    /// The revision up to which the watch has delivered every change.
    fn seen(&self) -> i64 {
        *self.seen.borrow()
    }

    fn seen_up_to(&self, revision: i64) {
        self.seen.send_if_modified(|s| {
            let newer = revision > *s;
            if newer {
                *s = revision;
            }
            newer
        });
    }

    /// Waits until the watch has delivered every change up to `revision`; false if it has
    /// not within `patience`.
    pub(super) async fn wait_seen(&self, revision: i64, patience: Duration) -> bool {
        let mut seen = self.seen.subscribe();
        let seen = seen.wait_for(|&s| s >= revision);
        matches!(tokio::time::timeout(patience, seen).await, Ok(Ok(_)))
    }

    /// An entry not this run's in `[offset, offset + len)`, as `(offset, length)`.
    pub(super) fn other_in(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let others = self.others.lock();
        // Extents do not overlap one another: the last that begins before the end is the
        // only one that can reach into the range.
        others
            .range(..offset + len)
            .next_back()
            .filter(|&(&o, &(l, _))| o + l > offset)
            .map(|(&o, &(l, _))| (o, l))
    }
}

/// Tells whether the entry watch lags: this host's last beat (which wrote its tick) not
/// delivered for longer than a renewal's period. Then the watch starts again from a read of
/// every entry, and goes to the etcd member the renewals go through
/// (`maru_cluster::Member::watch_entries`).
pub(super) struct Lag {
    /// Since when the watch has not delivered the beat it was then behind.
    since: Option<Instant>,
    limit: Duration,
}

impl Lag {
    pub(super) fn new(limit: Duration) -> Self {
        Lag { since: None, limit }
    }

    /// Whether the watch lags now, looked at every so often.
    pub(super) fn lags(&mut self, view: &View) -> bool {
        if view.seen() >= view.beaten.load(Ordering::Acquire) {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        since.elapsed() > self.limit
    }
}

#[cfg(test)]
mod tests {
    use maru_cluster::{EntryRecord, Listed};

    use super::*;

    fn record(node: &str, offset: u64, len: u64) -> EntryRecord {
        EntryRecord {
            node: node.into(),
            offset,
            len,
            alloc: 0,
        }
    }

    #[test]
    fn other_hosts_entries_follow_the_watch_and_reads() {
        let v = View::new("a", Arc::default());
        let put = |node: &str, offset, revision| EntryEvent::Put {
            ns: "ns".into(),
            name: format!("k{revision}"),
            record: record(node, offset, 4096),
            revision,
        };
        v.event(&put("b", 0x20_0000, 5));
        v.event(&put("a", 0x40_0000, 6));
        assert_eq!(v.other_in(0x20_0000, 0x20_0000), Some((0x20_0000, 4096)));
        assert_eq!(v.other_in(0x1f_f000, 0x1001), Some((0x20_0000, 4096)));
        assert_eq!(v.other_in(0x1f_f000, 0x1000), None);
        assert_eq!(v.other_in(0x40_0000, 0x20_0000), None, "this host's own");
        // A removal of an older entry at the offset leaves the newer one.
        let delete = |created, revision| EntryEvent::Delete {
            ns: "ns".into(),
            name: "k".into(),
            revision,
            created,
            record: Some(record("b", 0x20_0000, 4096)),
        };
        v.event(&delete(4, 7));
        assert!(v.other_in(0x20_0000, 1).is_some());
        v.event(&delete(5, 8));
        assert_eq!(v.other_in(0x20_0000, 0x20_0000), None);
        assert_eq!(*v.seen.borrow(), 8);
        // A read of every entry replaces them.
        v.read(&Snapshot {
            entries: vec![Listed {
                ns: "ns".into(),
                name: "x".into(),
                record: record("c", 0x60_0000, 100),
                revision: 9,
            }],
            revision: 12,
            ..Default::default()
        });
        assert_eq!(v.other_in(0x60_0000, 0x20_0000), Some((0x60_0000, 100)));
        assert_eq!(*v.seen.borrow(), 12);
    }

    #[test]
    fn an_earlier_run_s_entries_it_did_not_recover_count_as_another_host_s() {
        let v = View::new("a", Arc::default());
        let at = |created, offset| SharedId { created, offset };
        v.this_run(10, HashSet::from([at(4, 0x40_0000)]));
        let put = |offset, revision| EntryEvent::Put {
            ns: "ns".into(),
            name: format!("k{revision}"),
            record: record("a", offset, 4096),
            revision,
        };
        v.event(&put(0x20_0000, 3));
        v.event(&put(0x40_0000, 4));
        v.event(&put(0x80_0000, 4));
        v.event(&put(0x60_0000, 11));
        assert_eq!(v.other_in(0x20_0000, 0x20_0000), Some((0x20_0000, 4096)));
        assert_eq!(v.other_in(0x40_0000, 0x20_0000), None, "recovered");
        // Published in the same transaction as the recovered one, and not recovered.
        assert_eq!(v.other_in(0x80_0000, 0x20_0000), Some((0x80_0000, 4096)));
        assert_eq!(v.other_in(0x60_0000, 0x20_0000), None, "this run's");
        assert!(!v.own(&record("b", 0, 1), 11), "another host's");
    }

    #[test]
    fn only_this_host_s_own_ticks_make_the_view_fresh() {
        let v = View::new("a", Arc::default());
        let tick = |node: &str, until, revision| EntryEvent::Tick {
            node: node.into(),
            until,
            revision,
        };
        v.event(&tick("b", 5_000, 3));
        assert_eq!(v.valid(), 0);
        assert_eq!(*v.seen.borrow(), 3);
        v.event(&tick("a", 7_000, 4));
        v.event(&tick("a", 6_000, 5));
        assert_eq!(v.valid(), 7_000, "never back");
        v.applied(9_000);
        assert_eq!(v.valid(), 9_000);
    }

    #[test]
    fn a_watch_lags_once_behind_the_last_beat_for_longer_than_a_period() {
        let beaten = Arc::new(AtomicI64::new(5));
        let v = View::new("a", beaten.clone());
        let mut lag = Lag::new(Duration::from_millis(50));
        let tick = |revision| EntryEvent::Tick {
            node: "a".into(),
            until: 1,
            revision,
        };
        v.event(&tick(5));
        assert!(!lag.lags(&v));
        beaten.store(9, Ordering::Release);
        assert!(!lag.lags(&v), "behind since just now");
        std::thread::sleep(Duration::from_millis(60));
        assert!(lag.lags(&v));
        v.event(&tick(9));
        assert!(!lag.lags(&v));
        beaten.store(12, Ordering::Release);
        assert!(!lag.lags(&v), "a new beat, counted from now");
    }

    #[tokio::test]
    async fn a_claim_waits_for_the_watch_to_deliver_its_revision() {
        let v = Arc::new(View::new("a", Arc::default()));
        assert!(!v.wait_seen(10, Duration::from_millis(20)).await);
        let w = v.clone();
        let waiting = tokio::spawn(async move { w.wait_seen(10, Duration::from_secs(30)).await });
        v.event(&EntryEvent::Tick {
            node: "a".into(),
            until: 1,
            revision: 10,
        });
        assert!(waiting.await.expect("joined"));
    }
}
