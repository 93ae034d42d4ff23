//! The metadata authority: the one place that decides who owns a name (so that publication
//! stays write-once) and who owns each region of a raw pool. The store asks it before every
//! publication, rename and region carved, and tells it of every removal; its own maps are
//! then the local index of what the authority granted.
//!
//! This host alone is [`LocalAuthority`]. Several hosts sharing one pool plug in an authority
//! shared by all of them (claims as transactions in a replicated store), without the store's
//! decisions changing shape.

use std::collections::BTreeMap;

use maru::{Error, Result};
use parking_lot::Mutex;

use super::hashmap::HashMap;
use super::ids::{Place, SharedId};

/// A record asked of the authority, whose outcome may take a round trip to it: waited for
/// with the store's lock let go of (the lock's rule).
pub struct Recording(Box<dyn FnOnce() -> Result<()> + Send>);

impl Recording {
    /// A record whose outcome is known already.
    pub fn done(outcome: Result<()>) -> Self {
        Recording(Box::new(move || outcome))
    }

    /// A record whose outcome `wait` waits for.
    pub fn pending(wait: impl FnOnce() -> Result<()> + Send + 'static) -> Self {
        Recording(Box::new(wait))
    }

    /// The record's outcome.
    pub fn wait(self) -> Result<()> {
        (self.0)()
    }
}

/// A name's state at the authority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Reserved by a writer whose publication is on its way (generation `0`).
    Reserved(u64),
    /// Published under this generation.
    Published(u64),
}

/// Where a published entry's bytes are: its raw pool's UUID (None for a memfs pool, whose
/// entries no other host can see), the place in that pool and the size.
#[derive(Debug, Clone, Copy)]
pub struct Placed<'a> {
    pub pool: Option<&'a str>,
    pub place: Place,
    pub size: u64,
}

impl Placed<'_> {
    /// The raw offset, in the pool other hosts share: only raw pools are shared, and an entry
    /// of any other pool (`pool` None) is this host's alone, never published to the others.
    pub fn offset(&self) -> u64 {
        debug_assert!(self.pool.is_none() || self.place.extent().is_some());
        self.place.extent().unwrap_or(0)
    }
}

/// One publication of [`Authority::publish_many`]: `ns/key` as entry `id`, placed at `at`.
#[derive(Debug, Clone, Copy)]
pub struct Publishing<'a> {
    pub ns: &'a str,
    pub key: &'a str,
    pub id: u64,
    pub at: Placed<'a>,
}

/// A removal [`Authority::withdraw`] recorded: its revision at the authority, and whether
/// the entry was still there (false: another removal went first, which this one joins, at
/// that removal's revision: the one the hosts acknowledge as they apply it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Withdrawn {
    pub revision: i64,
    pub existed: bool,
}

/// Which entry of a name another host removed (`Store::forget_remote`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// This host's publication of the name.
    Own,
    /// Another host's entry, created at this revision of the authority.
    Remote(i64),
}

/// Decides who owns each name.
pub trait Authority: Send + Sync {
    /// Reserves `ns/key` for the entry (allocation) `id`: the name then cannot be taken by
    /// anyone else until [`Authority::publish`] or [`Authority::release`]. Fails with
    /// [`Error::Exists`] when another entry holds it. Reserving a name one already holds is a
    /// no-op.
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()>;
    /// Reserves `ns/key` as [`Authority::reserve`] does, for every host sharing the authority
    /// when the entry goes to raw pool `pool` (its UUID): for a writer whose publication
    /// follows later (through the mount, reported at its `close`).
    fn reserve_everywhere(&self, ns: &str, key: &str, id: u64, _pool: Option<&str>) -> Result<()> {
        self.reserve(ns, key, id)
    }
    /// Publishes `ns/key` as entry `id`, placed at `at` (reserving it first if needed).
    fn publish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<()>;
    /// Publishes each of `items` as [`Authority::publish`] does, with one outcome each; an
    /// authority shared by several hosts asks for them together. When the authority is
    /// [`Authority::shared`] and any item is in a raw pool, the store calls it without its
    /// lock (it makes a round trip); otherwise under it.
    fn publish_many(&self, items: &[Publishing<'_>]) -> Vec<Result<()>> {
        items
            .iter()
            .map(|p| self.publish(p.ns, p.key, p.id, &p.at))
            .collect()
    }
    /// Gives `ns/key` back, if `id` holds it: a reservation, or a publication being undone
    /// (its removal, for every host sharing the authority, as far as it can be done). Called
    /// under the store's lock, so never for a publication a shared authority granted in a
    /// pool it shares: the store removes that one as it removes an entry, the round trip made
    /// without the lock and the extent kept while other hosts may map it
    /// (`Store::give_back`).
    fn release(&self, ns: &str, key: &str, id: u64);
    /// The store marked its entry `ns/key` as being withdrawn (a delete, an eviction or a
    /// rename asks for its removal), under its lock. An authority shared by several hosts
    /// holds back the other hosts' changes of the name until [`Authority::settled`], as it
    /// does while this host publishes the name.
    fn withdrawing(&self, _ns: &str, _key: &str) {}
    /// The store is done changing `ns/key` here, under its lock: a publication the authority
    /// granted is sealed (or a renamed entry moved there), given back, or a withdrawal made
    /// or failed. The other hosts' changes of the name held back meanwhile apply from now
    /// on, to what the store has (applied before, a removal would find nothing here to
    /// remove and the store then seal an entry the cluster no longer has; another host's
    /// new entry of the name would find the name taken by the one going).
    fn settled(&self, _ns: &str, _key: &str) {}
    /// The round trip of removals, made first and without the store's lock: records the
    /// removal of each published entry of `items` for every host sharing the authority (in
    /// cluster mode, together: a group commit), one outcome each. `Some` is a removal made,
    /// for [`Authority::unpublish`] to complete; `None`, nothing to ask (this host's alone).
    /// A failure keeps the entry.
    fn withdraw(&self, items: &[Publishing<'_>]) -> Vec<Result<Option<Withdrawn>>> {
        items.iter().map(|_| Ok(None)).collect()
    }
    /// Removes published entry `ns/key` (`id`, placed at `at`), for every host sharing the
    /// authority (unless `withdrawn` says [`Authority::withdraw`] did): fails, keeping it,
    /// when that cannot be recorded. True when other hosts may still map its extent: it is
    /// freed only once [`Authority::held_elsewhere`] says no more.
    fn unpublish(
        &self,
        ns: &str,
        key: &str,
        id: u64,
        _at: &Placed<'_>,
        _withdrawn: Option<Withdrawn>,
    ) -> Result<bool> {
        self.release(ns, key, id);
        Ok(false)
    }
    /// Waits a moment (the space is wanted now, as for an eviction) until every host sharing
    /// the authority has acknowledged this host's removals; returns the removed extents, as
    /// (raw pool UUID, offset), that no host maps any more: no longer
    /// [`Authority::held_elsewhere`], the caller frees them.
    fn settle(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// Whether another host's entry `ns/key` that this host serves is an orphan: its
    /// publisher, the only host that evicts it, has been gone from the authority (its lease
    /// ran out and it has not come back) for the configured while. An eviction here may then
    /// take it, as a delete here would remove it. Called under the store's lock; asks nothing
    /// remote.
    fn orphaned(&self, _ns: &str, _key: &str) -> bool {
        false
    }
    /// Whether other hosts may still map the extent at `offset` of raw pool `pool`, which
    /// this host published and has removed.
    fn held_elsewhere(&self, _pool: &str, _offset: u64) -> bool {
        false
    }
    /// A client of this host is about to map or read another host's entry `id`: false when
    /// its removal has reached this host (the caller answers as if it were absent).
    /// Otherwise, until [`Authority::idle_remote`], a removal of it that arrives makes this
    /// host hold the extent — recorded before this host acknowledges the removal, so its
    /// publisher keeps the extent until this host lets go.
    /// Called under the store's lock; asks nothing remote.
    fn use_remote(&self, _id: SharedId) -> bool {
        true
    }
    /// Whether this host's own entry `ns/key` in the shared pool is removed at the authority
    /// by another host while the removal waits here (held back for a change of the name this
    /// host is making): new readers are refused it, as another host's removed entry is
    /// ([`Authority::use_remote`]), since nothing keeps its extent for them. Called under the
    /// store's lock; asks nothing remote.
    fn own_removed(&self, _ns: &str, _key: &str) -> bool {
        false
    }
    /// No client of this host maps another host's entry `id` any more (its last lease went):
    /// a hold on it is let go of.
    fn idle_remote(&self, _id: SharedId) {}
    /// Clients of this host map another host's entry `id`, placed at `at`, which is
    /// removed: this host holds the extent until [`Authority::idle_remote`] (a no-op when it
    /// does already). Called under the store's lock.
    fn hold(&self, _id: SharedId, _at: &Placed<'_>) {}
    /// Pins (or unpins) published entry `ns/key`, placed at `at`, for every host sharing the
    /// authority (its publisher never evicts it); fails, changing nothing, when that cannot be
    /// recorded.
    fn pin(&self, _ns: &str, _key: &str, _pinned: bool, _at: &Placed<'_>) -> Result<()> {
        Ok(())
    }
    /// Whether `ns/key` is pinned, by the newest change the authority knows of (None when it
    /// keeps no pins: the change the store made or was told of stands). The store marks an
    /// entry with this, under its lock, after each change it makes or is told of: changes
    /// that cross on their way (this host's and the watch's) end on the newest.
    fn pinned(&self, _ns: &str, _key: &str) -> Option<bool> {
        None
    }
    /// Clients of this host took their first pin (the original API's pin counts) on entries
    /// `names` that another host published: to be recorded for every host sharing the
    /// authority, bound to this host's life, so that their publisher does not evict them
    /// meanwhile. Asked at once, in the order of the store's lock (after the unpins asked
    /// before it); its outcome is waited for with the lock let go of ([`Recording::wait`]),
    /// and a failure changes nothing.
    fn pin_for_clients(&self, _names: &[(String, String)]) -> Recording {
        Recording::done(Ok(()))
    }
    /// The last pin of clients here on another host's entries `names` went (or the entries
    /// did): taken back, in the background.
    fn unpin_for_clients(&self, _names: &[(String, String)]) {}
    /// Sets (or clears) namespace `ns`'s quota for every host sharing the authority; fails,
    /// changing nothing, when that cannot be recorded.
    fn set_quota(&self, _ns: &str, _bytes: Option<u64>) -> Result<()> {
        Ok(())
    }
    /// Namespace `ns`'s quota by the newest change the authority knows of (None when it keeps
    /// no quotas); as [`Authority::pinned`].
    fn quota(&self, _ns: &str) -> Option<Option<u64>> {
        None
    }
    /// Another host's entry `ns/key` was used here: reported, in batches, to the host that
    /// evicts it (cluster-wide LRU).
    fn accessed(&self, _ns: &str, _key: &str) {}
    /// Files `ns/key` as entry `id` that another host published (nothing is asked).
    fn adopt(&self, ns: &str, key: &str, id: u64);
    /// Forgets `ns/key`, which another host removed (nothing is asked).
    fn forget(&self, ns: &str, key: &str);
    /// Another host's entry of `ns/key` filed here gave way to this host's publication `id`
    /// of the name, which the authority granted (that entry's removal is on its way): the
    /// other host's record of the name is forgotten, the name stays `id`'s, published by
    /// this host (nothing is asked).
    fn gave_way(&self, ns: &str, key: &str, id: u64) {
        self.adopt(ns, key, id);
    }
    /// Who holds `ns/key`.
    fn holder(&self, ns: &str, key: &str) -> Option<Claim>;
    /// Claims `[offset, offset + len)` of the raw pool `pool` (its UUID) for this host; fails
    /// with [`Error::Busy`] when any of it is claimed already.
    fn claim_region(&self, pool: &str, offset: u64, len: u64) -> Result<()>;
    /// Claims again a region holding this host's own entries (a restart recovering them):
    /// as [`Authority::claim_region`], but other hosts' mappings of them do not stand in the way.
    fn claim_again(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.claim_region(pool, offset, len)
    }
    /// Gives back the region of `pool` that starts at `offset`.
    fn release_region(&self, pool: &str, offset: u64);
    /// The regions of `pool` claimed, as (offset, len), in order.
    fn regions(&self, pool: &str) -> Vec<(u64, u64)>;
    /// Whether other hosts share the raw pools (cluster mode): they lock their devices
    /// shared, and a region another host claimed is skipped, not an error.
    fn shared(&self) -> bool {
        false
    }
    /// Whether raw pool `pool` (its UUID) is the one shared with other hosts: publications
    /// of its entries go to the authority they share.
    fn shares(&self, _pool: &str) -> bool {
        false
    }
    /// Whether this host lost the region of `pool` at `offset` to another host (cut off past
    /// its lease, the region was claimed meanwhile): nothing more may be placed in it.
    fn lost(&self, _pool: &str, _offset: u64) -> bool {
        false
    }
    /// The cluster as this host sees it (None on a single host); the store fills in the
    /// entry counts.
    fn cluster(&self) -> Option<maru::proto::ClusterInfo> {
        None
    }
    /// Until when (CLOCK_BOOTTIME, ns) this host may grant space of the shared pool and serve
    /// its entries: after that instant, another host may have carved again what this one
    /// granted or maps (its lease may have run out). `None`: no bound (a single host); 0: not
    /// now (cut off, or rejoining).
    fn fence(&self) -> Option<u64> {
        None
    }
    /// How many times this host has rejoined its cluster (0 on a single host). A read of the
    /// shared pool made without the store's lock is sound only if the host was not fenced
    /// off at its start and, at its end, is still not fenced off in the same epoch: its lease
    /// then lived throughout (a lease that ran out does not come back), so no other host
    /// carved again what it read.
    fn fence_epoch(&self) -> u64 {
        0
    }
    /// Whether the shared pool is fenced off now ([`Authority::fence`] passed).
    fn fenced(&self) -> bool {
        self.fence()
            .is_some_and(|until| maru::index::boottime_ns() >= until)
    }
}

/// The error of a request fenced off ([`Authority::fenced`]).
pub fn fenced_error() -> Error {
    Error::Busy(
        "this host is cut off from the cluster (its lease may have run out, or its view of the \
         cluster's entries lags): the shared pool is neither written nor read here until it \
         has caught up"
            .into(),
    )
}

/// The authority of a single host: an in-memory map.
#[derive(Debug, Default)]
pub struct LocalAuthority {
    names: Mutex<HashMap<(String, String), Claim>>,
    regions: Mutex<HashMap<String, BTreeMap<u64, u64>>>,
}

impl Authority for LocalAuthority {
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        let mut m = self.names.lock();
        match m.get(&(ns.to_owned(), key.to_owned())) {
            Some(Claim::Reserved(h) | Claim::Published(h)) if *h == id => Ok(()),
            Some(_) => Err(Error::Exists(format!("{ns}/{key}"))),
            None => {
                m.insert((ns.to_owned(), key.to_owned()), Claim::Reserved(id));
                Ok(())
            }
        }
    }

    fn publish(&self, ns: &str, key: &str, id: u64, _at: &Placed<'_>) -> Result<()> {
        let mut m = self.names.lock();
        let k = (ns.to_owned(), key.to_owned());
        match m.get(&k) {
            Some(Claim::Reserved(h) | Claim::Published(h)) if *h != id => {
                Err(Error::Exists(format!("{ns}/{key}")))
            }
            _ => {
                m.insert(k, Claim::Published(id));
                Ok(())
            }
        }
    }

    fn release(&self, ns: &str, key: &str, id: u64) {
        let mut m = self.names.lock();
        let k = (ns.to_owned(), key.to_owned());
        if matches!(m.get(&k), Some(Claim::Reserved(h) | Claim::Published(h)) if *h == id) {
            m.remove(&k);
        }
    }

    fn adopt(&self, ns: &str, key: &str, id: u64) {
        self.names
            .lock()
            .insert((ns.to_owned(), key.to_owned()), Claim::Published(id));
    }

    fn forget(&self, ns: &str, key: &str) {
        self.names.lock().remove(&(ns.to_owned(), key.to_owned()));
    }

    fn holder(&self, ns: &str, key: &str) -> Option<Claim> {
        self.names
            .lock()
            .get(&(ns.to_owned(), key.to_owned()))
            .copied()
    }

    fn claim_region(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        let mut m = self.regions.lock();
        let r = m.entry(pool.to_owned()).or_default();
        let end = offset + len;
        let before = r.range(..end).next_back();
        if before.is_some_and(|(o, l)| o + l > offset) {
            return Err(Error::Busy(format!(
                "region {offset:#x}+{len:#x} of pool {pool} is claimed already"
            )));
        }
        r.insert(offset, len);
        Ok(())
    }

    fn release_region(&self, pool: &str, offset: u64) {
        if let Some(r) = self.regions.lock().get_mut(pool) {
            r.remove(&offset);
        }
    }

    fn regions(&self, pool: &str) -> Vec<(u64, u64)> {
        self.regions
            .lock()
            .get(pool)
            .map(|r| r.iter().map(|(o, l)| (*o, *l)).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_write_once() {
        let a = LocalAuthority::default();
        a.reserve("ns", "k", 7).unwrap();
        a.reserve("ns", "k", 7).unwrap();
        assert!(matches!(a.reserve("ns", "k", 8), Err(Error::Exists(_))));
        let at = Placed {
            pool: None,
            place: Place::NOWHERE,
            size: 1,
        };
        assert!(matches!(
            a.publish("ns", "k", 8, &at),
            Err(Error::Exists(_))
        ));
        a.publish("ns", "k", 7, &at).unwrap();
        assert_eq!(a.holder("ns", "k"), Some(Claim::Published(7)));
        a.release("ns", "k", 8);
        assert_eq!(a.holder("ns", "k"), Some(Claim::Published(7)));
        a.release("ns", "k", 7);
        assert_eq!(a.holder("ns", "k"), None);
        a.publish("ns", "k", 9, &at).unwrap();
        a.forget("ns", "k");
        a.adopt("ns", "k", 10);
        assert_eq!(a.holder("ns", "k"), Some(Claim::Published(10)));
    }

    #[test]
    fn regions_are_claimed_once() {
        let a = LocalAuthority::default();
        a.claim_region("p", 4 << 20, 2 << 20).unwrap();
        assert!(matches!(
            a.claim_region("p", 5 << 20, 4 << 20),
            Err(Error::Busy(_))
        ));
        assert!(matches!(
            a.claim_region("p", 2 << 20, 4 << 20),
            Err(Error::Busy(_))
        ));
        a.claim_region("p", 2 << 20, 2 << 20).unwrap();
        a.claim_region("q", 4 << 20, 2 << 20).unwrap();
        assert_eq!(a.regions("p"), [(2 << 20, 2 << 20), (4 << 20, 2 << 20)]);
        a.release_region("p", 4 << 20);
        a.claim_region("p", 4 << 20, 8 << 20).unwrap();
    }
}
