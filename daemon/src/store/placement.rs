//! Placement across pools and eviction.
//!
//! An allocation tries the pools in command-line order (or the one the client names) without
//! evicting; if none has room and eviction is `lru`, it evicts the least recently used sealed,
//! unpinned, unheld, unleased entries of the first pool large enough and retries.

use maru::{Error, Result};

use super::Store;
use super::deletion::Found;
use super::entries::Removal;
use super::ids::PoolIdx;
use super::locked::Locked;
use super::pools::{Backing, Requester};
use super::settings::Eviction;
use crate::pool::ENTRY_ALIGN;

impl Store {
    /// Evicts LRU entries of `pool` (any pool when `None`) until `want` bytes were freed;
    /// returns (entries, bytes) evicted. The mount is told of each at once (from inside the
    /// lock: dropping an entry's passthrough backing is an ioctl that takes no store lock, and
    /// the names go to their own thread), so that the pool's free space shows the eviction
    /// before the next look at it. Entries of a pool shared with other hosts are evicted as
    /// a delete removes them (`deletion`): their removals recorded at the authority in one
    /// go without the lock, and the wait for the other hosts' acknowledgements without it too.
    pub(super) fn evict_lru(
        &self,
        st: &mut Locked<'_>,
        pool: Option<PoolIdx>,
        want: u64,
    ) -> (u64, u64) {
        let s = &mut **st;
        s.lru.settle(&mut s.entries);
        let candidates: Vec<u64> = s
            .lru
            .oldest_first()
            .filter(|ino| {
                let e = &s.entries[ino];
                !e.protected() && pool.is_none_or(|p| p == e.pool())
            })
            .collect();
        let shared = self.authority.shared()
            && candidates
                .iter()
                .any(|ino| s.placed(&s.entries[ino]).pool.is_some());
        if shared {
            return self.evict_shared(st, candidates, want);
        }
        let (mut freed, mut count) = (0, 0);
        for ino in candidates {
            if freed >= want {
                break;
            }
            let asize = st.entries[&ino].asize();
            match st.remove_entry(&*self.authority, &self.counters, ino, Removal::Evicted) {
                Ok(Some(i)) => {
                    freed += asize;
                    count += 1;
                    self.notify(vec![i]);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("evicting: {e}");
                    break;
                }
            }
        }
        if count > 0 {
            // Removals of this host's that other hosts acknowledged meanwhile (a wait for
            // etcd, without the lock); and the log's sync of these (`--wal-sync`), so that
            // their extents are free for the grant they make room for.
            self.free_acknowledged(st);
            st.sync();
        }
        (count, freed)
    }

    /// Frees the removed extents every host sharing their pool acknowledged
    /// ([`super::authority::Authority::settle`], made without the lock).
    fn free_acknowledged(&self, st: &mut Locked<'_>) {
        if !self.authority.shared() {
            return; // a host alone: nothing to wait for, the lock is kept
        }
        let free = st.unlocked(|| self.authority.settle());
        for (pool, offset) in free {
            st.free_unheld(&*self.authority, &pool, offset);
        }
    }

    /// [`Store::evict_lru`] of `candidates` (oldest first) in a pool shared with other hosts.
    fn evict_shared(&self, st: &mut Locked<'_>, candidates: Vec<u64>, want: u64) -> (u64, u64) {
        let (mut chosen, mut sizes) = (Vec::new(), Vec::new());
        let mut planned = 0;
        for ino in candidates {
            if planned >= want {
                break;
            }
            let e = &st.entries[&ino];
            planned += e.asize();
            sizes.push(e.asize());
            chosen.push(Found::of(st, e));
        }
        let (removed, inv) = self.remove_found(st, &chosen, true);
        let (mut freed, mut count) = (0, 0);
        for (r, size) in removed.iter().zip(sizes) {
            match r {
                Ok(()) => {
                    freed += size;
                    count += 1;
                }
                Err(e) => tracing::warn!("evicting: {e}"),
            }
        }
        self.notify(inv);
        if count > 0 {
            // Hosts sharing the pool may map what was evicted: the space comes back once each
            // acknowledged the removals (one wait for the whole batch, without the lock), and
            // once their records are synced (`--wal-sync`).
            self.free_acknowledged(st);
            st.sync();
        }
        (count, freed)
    }

    /// Evicts least recently used entries of `pool` until `want` bytes are free (with eviction
    /// on; nothing otherwise). Returns whether that much is free.
    pub(super) fn ensure_free(&self, st: &mut Locked<'_>, pool: PoolIdx, want: u64) -> bool {
        let want = want.min(st.pools[pool].pool.capacity());
        for _round in 0..32 {
            let free = st.pools[pool].pool.free_space();
            if free >= want {
                return true;
            }
            if self.cfg.eviction != Eviction::Lru {
                return false;
            }
            let (n, _) = self.evict_lru(st, Some(pool), want - free + ENTRY_ALIGN);
            if n == 0 {
                return false;
            }
        }
        false
    }

    /// Reserves `size` bytes for allocation `id` of `who` in a pool (`hint`, or each in
    /// order), evicting if allowed. Returns the pool and the backing. Called with the lock
    /// held, it releases it only while it makes the slow part of a grant (a memfs file's
    /// `fallocate`, [`pools::Prepare`](super::pools::Prepare)), so one client's large
    /// allocation does not stall the others; everything else it does under the lock.
    pub(super) fn place(
        &self,
        st: &mut Locked<'_>,
        who: &Requester<'_>,
        id: u64,
        size: u64,
        hint: Option<PoolIdx>,
    ) -> Result<(PoolIdx, Backing)> {
        let order: Vec<PoolIdx> = match hint {
            Some(p) => vec![p],
            None => (0..st.pools.len()).map(PoolIdx::at).collect(),
        };
        let big_enough = order
            .iter()
            .copied()
            .find(|p| size <= st.pools[*p].pool.capacity());
        if let Some(p) = big_enough {
            // First pass: no eviction. A pool that fails for another reason than room (its
            // region's claim could not be made: etcd unreachable) says why, if none grants.
            let mut failed = None;
            for &q in &order {
                match self.grant(st, q, who, id, size) {
                    Ok(b) => return Ok((q, b)),
                    Err(Error::NoSpace(_)) => {}
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            if self.cfg.eviction == Eviction::Lru {
                // Evict what is missing plus some headroom: memory of evicted entries that a
                // client still maps is freed only when it unmaps, so a round may free less
                // than it evicted; keep going while there is something to evict.
                let headroom = (st.pools[p].pool.capacity() / 64).max(size);
                for _round in 0..32 {
                    let free = st.pools[p].pool.free_space();
                    let deficit = size.saturating_sub(free).max(ENTRY_ALIGN) + headroom;
                    let (n, _) = self.evict_lru(st, Some(p), deficit);
                    match self.grant(st, p, who, id, size) {
                        Ok(b) => return Ok((p, b)),
                        Err(Error::NoSpace(_)) if n > 0 => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Err(Error::NoSpace(format!(
            "no pool has {} free{}",
            maru::size::format_size(size),
            if self.cfg.eviction == Eviction::Off {
                " (eviction is off)"
            } else {
                ""
            }
        )))
    }

    /// One grant in pool `q`: its slow part made with the lock released where the pool has
    /// one for it, else made by the pool under the lock; a region it carved is claimed at
    /// the authority before it is given ([`Store::claim`]), another tried when another host
    /// claimed that one first.
    fn grant(
        &self,
        st: &mut Locked<'_>,
        q: PoolIdx,
        who: &Requester<'_>,
        id: u64,
        size: u64,
    ) -> Result<Backing> {
        let mut refused = Refused::default();
        loop {
            let b = match &self.preparers[q.slot()] {
                Some(p) if p.prepares(size, who) => st.unlocked(|| p.prepare(size))?,
                _ => st.pools[q].pool.grant(id, size, who)?,
            };
            let Some(region) = st.pools[q].pool.unclaimed(id) else {
                return Ok(b);
            };
            // Refused, the region went with the grant (`Pool::claimed`).
            match self.claim(st, q, region) {
                Ok(()) => return Ok(b),
                Err(e) => refused.again(e, region.0, &st.pools[q].name)?,
            }
        }
    }

    /// Claims at the authority the region `(offset, len)` pool `q` carved for an allocation
    /// ([`Pool::unclaimed`](super::pools::Pool::unclaimed)), and tells the pool how it went.
    /// Where other hosts share the authority the claim is a round trip (etcd): it is made
    /// with the store's lock let go of, so that nobody else waits for it (nothing else is
    /// placed in the region meanwhile).
    pub(super) fn claim(
        &self,
        st: &mut Locked<'_>,
        q: PoolIdx,
        (offset, len): (u64, u64),
    ) -> Result<()> {
        let uuid = st.pools[q]
            .pool
            .uuid()
            .expect("only raw pools carve regions")
            .to_owned();
        let claim = || self.authority.claim_region(&uuid, offset, len);
        let r = if self.authority.shared() {
            st.unlocked(claim)
        } else {
            claim()
        };
        st.pools[q].pool.claimed(offset, &r);
        r
    }
}

/// The regions whose claims other hosts refused to one placement: it tries other regions
/// ([`Error::Busy`]: another host claimed the region first) until one is refused a second
/// time (the pool, tried again once it looked full, has no region free of other hosts').
#[derive(Default)]
pub(super) struct Refused(std::collections::HashSet<u64>);

impl Refused {
    /// Whether to try another region after the claim of region `offset` of pool `pool`
    /// failed with `e`: Ok to try again, else the error to give.
    pub(super) fn again(&mut self, e: Error, offset: u64, pool: &str) -> Result<()> {
        match e {
            Error::Busy(_) if self.0.insert(offset) => Ok(()),
            Error::Busy(_) => Err(Error::NoSpace(format!(
                "pool {pool} is full (other hosts claim what is free)"
            ))),
            e => Err(e),
        }
    }
}
