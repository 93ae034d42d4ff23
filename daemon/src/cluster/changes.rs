//! The changes the applier applies (`applier`), and the names this host is changing, whose
//! changes by other hosts wait until the store is done with them.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use maru_cluster::{EntryEvent, Snapshot};
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

/// What the watch hands the applier thread.
pub(super) enum Change {
    /// Every entry at a revision (after a (re)start of the watch); `done` once applied (and
    /// acknowledged).
    All(Snapshot, tokio::sync::oneshot::Sender<()>),
    Event(EntryEvent),
    /// No host maps this removed extent of this host's any more.
    Unheld(u64),
    /// Every pinned entry at a revision (after a (re)start of the pins' watch).
    Pins(Vec<(String, String)>, i64),
    /// A pin or an unpin, at its revision.
    Pin(String, String, bool, i64),
    /// Entries of this host's that other hosts used (oldest use first).
    Used(Vec<(String, String)>),
    /// Every quota at a revision (after a (re)start of the quotas' watch).
    Quotas(Vec<(String, u64)>, i64),
    /// A quota set (or cleared).
    Quota(String, Option<u64>, i64),
    /// Every entry clients pin, as (namespace, name, node), at a revision (after a (re)start
    /// of the client pins' watch).
    ClientPins(Vec<(String, String, String)>),
    /// Clients of a node pinned an entry, or no longer do.
    ClientPin(String, String, String, bool),
    /// Until when clients may trust the indexes ([`crate::store::Store::set_fence`]).
    Fence(u64),
    /// Entry `ns/key` (`entry`: its revision and offset) was removed at `revision` (from the
    /// watch, or found by a read of every entry).
    Removed {
        ns: String,
        key: String,
        revision: i64,
        entry: crate::store::SharedId,
    },
    /// A change held back while this host changed its name, given back once the store
    /// settled it, with the count of reads of every entry begun before it was held: one
    /// begun since has it already, and more (see [`Changing::superseded`]).
    Held(u64, Box<Change>),
    /// The store settled `ns/key`: the changes held back go now ([`Changing::release`]),
    /// before any change of the name queued behind this one.
    Release(String, String),
}

/// A change held back, with the count of reads of every entry begun before it was held.
pub(super) type HeldChange = (u64, Change);

/// The changes of a name held back, and whether the store has settled the name since.
#[derive(Default)]
struct Pending {
    held: Vec<HeldChange>,
    settled: bool,
}

/// Names this host is changing in the shared pool — publishing (from the ask until the store
/// sealed or gave back the entry) or withdrawing (from the store's mark until it removed the
/// entry or kept it) — each with the other hosts' changes of the name the watch (or a read of
/// every entry) brought meanwhile, in order: applied once the store has settled the name
/// (`Authority::settled`), to what it has then, and before any change of the name that
/// the applier's queue had behind them (seed 420: a removal that came out of the queue
/// between the settling and the changes held back was applied first, and the older entry
/// held back was then filed again over nothing, served from an extent carved again).
#[derive(Default)]
pub(super) struct Changing {
    names: Mutex<HashMap<(String, String), Pending>>,
    /// Reads of every entry the applier has begun to apply.
    reads: AtomicU64,
    /// The applier's queue, where the changes held back go once their name is settled.
    again: OnceLock<UnboundedSender<Change>>,
}

impl Changing {
    /// Where the changes held back go once their name is settled: the applier's queue.
    pub(super) fn apply_to(&self, queue: UnboundedSender<Change>) {
        let _ = self.again.set(queue);
    }

    /// This host begins changing `ns/key`.
    pub(super) fn begin(&self, ns: &str, key: &str) {
        self.names
            .lock()
            .entry((ns.to_owned(), key.to_owned()))
            .or_default()
            .settled = false;
    }

    /// Holds `change` of `ns/key` back if this host is changing the name, or settled it but
    /// the changes held back are not applied yet (None then); gives it back otherwise.
    pub(super) fn hold_back(&self, ns: &str, key: &str, change: Change) -> Option<Change> {
        match self.names.lock().get_mut(&(ns.to_owned(), key.to_owned())) {
            Some(p) => {
                tracing::debug!(ns, key, "a change of a name being changed here: held back");
                p.held.push((self.reads.load(Ordering::Acquire), change));
                None
            }
            None => Some(change),
        }
    }

    /// The store settled `ns/key`: the changes of the name held back meanwhile, and those
    /// the applier comes to until then, go once the applier comes to the
    /// [`Change::Release`] this sends (behind what the store did), in order.
    pub(super) fn settle(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        let mut names = self.names.lock();
        let Some(p) = names.get_mut(&name) else {
            return;
        };
        if p.held.is_empty() {
            names.remove(&name);
            return;
        }
        p.settled = true;
        if let Some(queue) = self.again.get() {
            let _ = queue.send(Change::Release(name.0, name.1));
        }
    }

    /// The changes of `ns/key` held back, in order, for the applier to apply now, unless this
    /// host began changing the name again since it settled it (they wait for that change's
    /// settling, which sends another [`Change::Release`]).
    pub(super) fn release(&self, ns: &str, key: &str) -> Vec<HeldChange> {
        let name = (ns.to_owned(), key.to_owned());
        let mut names = self.names.lock();
        if !names.get(&name).is_some_and(|p| p.settled) {
            return Vec::new();
        }
        names.remove(&name).map(|p| p.held).unwrap_or_default()
    }

    /// The applier begins to apply a read of every entry.
    pub(super) fn read_begins(&self) {
        self.reads.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether a change held back when `read` reads of every entry had begun is out of date:
    /// a read begun since reflects etcd at a later revision than the change (its watch
    /// starts where that read ends), and it may come out of the queue behind that read
    /// (it went back in when the store settled the name), where applying it would undo
    /// what the read filed (seed 307: an older entry of a name filed over the newer one).
    pub(super) fn superseded(&self, read: u64) -> bool {
        self.reads.load(Ordering::Acquire) > read
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru_cluster::EntryRecord;

    fn put(created: i64) -> Change {
        Change::Event(EntryEvent::Put {
            ns: "ns".into(),
            name: "k".into(),
            record: EntryRecord {
                offset: 0xa0_0000,
                len: 4096,
                node: "h0".into(),
                alloc: 1,
            },
            revision: created,
        })
    }

    fn delete(revision: i64, created: i64) -> Change {
        Change::Removed {
            ns: "ns".into(),
            key: "k".into(),
            revision,
            entry: crate::store::SharedId {
                created,
                offset: 0xa0_0000,
            },
        }
    }

    /// The applier's way with the queue, on a map of name to creation revision: a change of
    /// the name goes through `hold_back` first (as `file` and `removed` do), a release
    /// applies what was held.
    fn drain(
        changing: &Changing,
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<Change>,
        filed: &mut Option<i64>,
    ) {
        fn one(changing: &Changing, c: Change, filed: &mut Option<i64>) {
            match c {
                Change::Release(ns, key) => {
                    for (read, c) in changing.release(&ns, &key) {
                        one(changing, Change::Held(read, Box::new(c)), filed);
                    }
                }
                Change::Held(read, c) => {
                    if !changing.superseded(read) {
                        one(changing, *c, filed);
                    }
                }
                Change::All(all, ..) => {
                    changing.read_begins();
                    for l in all.entries {
                        one(changing, put(l.revision), filed);
                    }
                }
                c => {
                    let Some(c) = changing.hold_back("ns", "k", c) else {
                        return;
                    };
                    match c {
                        Change::Event(EntryEvent::Put { revision, .. }) => *filed = Some(revision),
                        Change::Removed { entry, .. } => {
                            if *filed == Some(entry.created) {
                                *filed = None;
                            }
                        }
                        _ => unreachable!(),
                    }
                }
            }
        }
        while let Ok(c) = rx.try_recv() {
            one(changing, c, filed);
        }
    }

    /// Seed 420: while this host deleted `k`, a read of every entry brought `k` (created at
    /// 8015) and it was held back; the removal (8056) was queued before the store settled
    /// the name. The entry held back is filed, then removed: `k` is not served.
    #[test]
    fn a_change_queued_behind_the_settling_waits_for_those_held_back() {
        let changing = Changing::default();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        changing.apply_to(tx.clone());
        let mut filed = Some(8015);
        changing.begin("ns", "k");
        assert!(changing.hold_back("ns", "k", put(8015)).is_none());
        tx.send(delete(8056, 8015)).expect("queue");
        changing.settle("ns", "k");
        drain(&changing, &mut rx, &mut filed);
        assert_eq!(
            filed, None,
            "the removal applied before the entry held back"
        );
        // Nothing is left held: a later change applies at once.
        assert!(changing.hold_back("ns", "k", put(9000)).is_some());
    }

    /// A name this host began changing again before the release came out of the queue: what
    /// was held waits for that change to settle too.
    #[test]
    fn a_release_waits_for_a_change_begun_again() {
        let changing = Changing::default();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        changing.apply_to(tx);
        let mut filed = None;
        changing.begin("ns", "k");
        assert!(changing.hold_back("ns", "k", put(10)).is_none());
        changing.settle("ns", "k");
        changing.begin("ns", "k");
        drain(&changing, &mut rx, &mut filed);
        assert_eq!(filed, None, "applied while the name was being changed");
        changing.settle("ns", "k");
        drain(&changing, &mut rx, &mut filed);
        assert_eq!(filed, Some(10));
    }

    /// Seed 307's kind: a change held back (`k` created at 11695), and a read of every entry
    /// queued before the store settled the name, which no longer has `k` (removed meanwhile,
    /// so nothing of the name comes in behind the held change): applied after that read, the
    /// held change would file the removed entry again. It is passed by.
    #[test]
    fn a_change_held_back_is_passed_by_once_a_later_read_began() {
        let changing = Changing::default();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        changing.apply_to(tx.clone());
        let mut filed = None;
        changing.begin("ns", "k");
        assert!(changing.hold_back("ns", "k", put(11695)).is_none());
        let (done, _) = tokio::sync::oneshot::channel();
        let all = Snapshot {
            revision: 12140,
            ..Snapshot::default()
        };
        tx.send(Change::All(all, done)).expect("queue");
        changing.settle("ns", "k");
        drain(&changing, &mut rx, &mut filed);
        assert_eq!(filed, None);
    }
}
