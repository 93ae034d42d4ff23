//! The changes the applier applies (`applier`), and the names this host is changing, whose
//! changes by other hosts wait until the store is done with them.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use maru_cluster::{EntryEvent, Listed};
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

/// What the watch hands the applier thread.
pub(super) enum Change {
    /// Every entry at a revision (after a (re)start of the watch); `done` once applied (and
    /// acknowledged).
    All(Vec<Listed>, i64, tokio::sync::oneshot::Sender<()>),
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
    /// Entry `ns/key` created at revision `created` was removed at `revision` (a removal
    /// held back while this host changed the name, or one a read of every entry found).
    Removed {
        ns: String,
        key: String,
        revision: i64,
        created: i64,
    },
    /// A change held back while this host changed its name, given back once the store
    /// settled it, with the count of reads of every entry begun before it was held: one
    /// begun since has it already, and more (see [`Changing::superseded`]).
    Held(u64, Box<Change>),
}

/// A change held back, with the count of reads of every entry begun before it was held.
type HeldChange = (u64, Change);

/// Names this host is changing in the shared pool — publishing (from the ask until the store
/// sealed or gave back the entry) or withdrawing (from the store's mark until it removed the
/// entry or kept it) — each with the other hosts' changes of the name the watch (or a read of
/// every entry) brought meanwhile, in order: applied once the store has settled the name
/// (`Authority::settled`), to what it has then.
#[derive(Default)]
pub(super) struct Changing {
    names: Mutex<HashMap<(String, String), Vec<HeldChange>>>,
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
            .or_default();
    }

    /// Holds `change` of `ns/key` back if this host is changing the name (None then), to be
    /// applied once the store has settled it; gives it back otherwise.
    pub(super) fn hold_back(&self, ns: &str, key: &str, change: Change) -> Option<Change> {
        match self.names.lock().get_mut(&(ns.to_owned(), key.to_owned())) {
            Some(held) => {
                tracing::debug!(ns, key, "a change of a name being changed here: held back");
                held.push((self.reads.load(Ordering::Acquire), change));
                None
            }
            None => Some(change),
        }
    }

    /// The store settled `ns/key`: the changes of the name held back meanwhile go to the
    /// applier again, in order, behind what the store did.
    pub(super) fn settle(&self, ns: &str, key: &str) {
        let Some(held) = self.names.lock().remove(&(ns.to_owned(), key.to_owned())) else {
            return;
        };
        let Some(queue) = self.again.get() else {
            return;
        };
        for (read, change) in held {
            tracing::debug!(ns, key, "a change held back, applied");
            let _ = queue.send(Change::Held(read, Box::new(change)));
        }
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
