//! Other hosts' entries as clients of this host use them: which are mapped here, which are
//! removed and refused to new readers, and the holds that keep a removed one's extent from
//! its publisher while clients here still map it.

use std::collections::{HashMap, HashSet};

use crate::store::SharedId;

/// Other hosts' entries, each by its revision and offset (one transaction publishes several
/// at one revision), as clients of this host use them.
#[derive(Debug, Default)]
pub(super) struct Readers {
    /// Mapped or read here now (leases): a removal of one makes this host hold its extent.
    pub(super) used: HashSet<SharedId>,
    /// Removals that reached this host and that its store has not applied yet: refused to
    /// new readers (this host may already have acknowledged them).
    pub(super) removed: HashSet<SharedId>,
    /// Holds on removed entries that clients here still map.
    pub(super) holds: HashMap<SharedId, Hold>,
}

impl Readers {
    /// A client here is about to use entry `id`: false once its removal has arrived.
    pub(super) fn start(&mut self, id: SharedId) -> bool {
        if self.removed.contains(&id) {
            return false;
        }
        self.used.insert(id);
        true
    }

    /// No client here uses entry `id` any more: its hold, if any, to let go of.
    pub(super) fn stop(&mut self, id: SharedId) -> Option<Hold> {
        self.used.remove(&id);
        self.holds.remove(&id)
    }

    /// The removal of entry `id` (its extent `len` bytes long) arrived: new users are
    /// refused, and if clients here use it, it is held (as `tag`). True when a hold was taken.
    pub(super) fn removal(&mut self, id: SharedId, len: u64, tag: u64) -> bool {
        self.removed.insert(id);
        self.used.contains(&id) && self.hold(id, len, tag)
    }

    /// Holds the extent of removed entry `id` (`len` bytes) for clients here (recorded with
    /// the next acknowledgement), unless it is held already; true when it was not.
    pub(super) fn hold(&mut self, id: SharedId, len: u64, tag: u64) -> bool {
        self.used.insert(id);
        if self.holds.contains_key(&id) {
            return false;
        }
        let h = Hold {
            offset: id.offset,
            len,
            tag,
            recorded: false,
            unanswered: false,
        };
        self.holds.insert(id, h);
        true
    }
}

/// A hold of this host on another host's removed entry (see [`Authority::hold`](crate::store::authority::Authority::hold)).
#[derive(Debug, Clone)]
pub(super) struct Hold {
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Its records' tag (unique here): a new hold on the same extent never meets an old one's
    /// late deletion.
    pub(super) tag: u64,
    /// In etcd (recorded with the next acknowledgement; again after a rejoin).
    pub(super) recorded: bool,
    /// A recording of it under the current lease went unanswered: it may land unseen.
    pub(super) unanswered: bool,
}

#[cfg(test)]
mod tests {
    use super::{Readers, SharedId};

    #[test]
    fn a_removal_holds_what_clients_use_and_refuses_new_users() {
        let mut r = Readers::default();
        let at = |created, offset| SharedId { created, offset };
        // Used when its removal arrives: held, and refused to anyone new.
        assert!(r.start(at(10, 4096)));
        assert!(r.removal(at(10, 4096), 8192, 1));
        assert!(!r.start(at(10, 4096)));
        assert!(!r.hold(at(10, 4096), 8192, 2), "held once");
        let h = r.stop(at(10, 4096)).expect("held");
        assert_eq!((h.offset, h.len, h.tag, h.recorded), (4096, 8192, 1, false));
        assert!(r.holds.is_empty() && r.used.is_empty());
        // Used, then let go of, before its removal: nothing held.
        assert!(r.start(at(20, 0)));
        assert!(r.stop(at(20, 0)).is_none());
        assert!(!r.removal(at(20, 0), 4096, 3));
        assert!(!r.start(at(20, 0)));
        // Not used at all: nothing held; a removal the store applied is forgotten.
        assert!(!r.removal(at(30, 0), 4096, 4));
        assert_eq!(
            r.removed,
            [at(10, 4096), at(20, 0), at(30, 0)].into_iter().collect()
        );
        assert!(r.holds.is_empty());
        // Removed on this host (its store first): held for its clients, then let go of.
        assert!(r.hold(at(40, 0), 4096, 5));
        assert!(!r.removal(at(40, 0), 4096, 6), "held already");
        assert_eq!(r.stop(at(40, 0)).map(|h| h.tag), Some(5));
    }

    /// Entries published in one transaction share their revision (seed 1726): a removal of
    /// one refuses no reader of another, and each is held on its own for its clients.
    #[test]
    fn entries_of_one_revision_are_removed_and_held_each_on_its_own() {
        let mut r = Readers::default();
        let (a, b) = (
            SharedId {
                created: 7,
                offset: 0,
            },
            SharedId {
                created: 7,
                offset: 8192,
            },
        );
        assert!(r.start(a) && r.start(b));
        assert!(r.removal(a, 4096, 1));
        assert!(!r.start(a) && r.start(b), "b's reader is served");
        assert!(r.removal(b, 4096, 2), "b is held too");
        assert_eq!(r.stop(a).map(|h| (h.offset, h.tag)), Some((0, 1)));
        assert_eq!(r.stop(b).map(|h| (h.offset, h.tag)), Some((8192, 2)));
    }
}
