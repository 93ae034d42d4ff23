//! Placement across pools and eviction.
//!
//! An allocation tries the pools in command-line order (or the one the client names) without
//! evicting; if none has room and eviction is `lru`, it evicts the least recently used sealed,
//! unpinned, unheld, unleased entries of the first pool large enough and retries. Packed
//! entries go by whole packs, since a pack's memory comes back only with its last entry
//! ([`victims`]).

use maru::{Error, Result};

use super::Store;
use super::deletion::Found;
use super::entries::{Entry, Removal};
use super::hashmap::HashMap;
use super::ids::PoolIdx;
use super::locked::Locked;
use super::pools::Usage;
use super::pools::{Backing, Requester};
use super::settings::Eviction;
use crate::pool::ENTRY_ALIGN;

impl Store {
    /// Evicts LRU entries of `pool` (any pool when `None`) until `want` bytes were freed, in
    /// the order of [`victims`]; returns (entries evicted, bytes freed: a packed entry's count
    /// only with its pack's last). The mount is told of each at once (from inside the
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
        let candidates: Vec<Candidate> = s
            .lru
            .oldest_first()
            .map(|ino| &s.entries[&ino])
            .filter(|e| pool.is_none_or(|p| p == e.pool()))
            .filter(|e| {
                !e.protected()
                    || (e.remote().is_some()
                        && !e.kept()
                        && self.authority.orphaned(e.ns(), e.key()))
            })
            .map(Candidate::of)
            .collect();
        let chosen = victims(&candidates, |p, pack| s.pools[p].pool.pack(pack));
        let shared = self.authority.shared()
            && chosen
                .iter()
                .any(|v| s.placed(&s.entries[&v.ino]).pool.is_some());
        if shared {
            return self.evict_shared(st, chosen, want);
        }
        let (mut freed, mut count) = (0, 0);
        for v in chosen {
            if freed >= want {
                break;
            }
            match st.remove_entry(&*self.authority, &self.counters, v.ino, Removal::Evicted) {
                Ok(Some(i)) => {
                    freed += v.frees;
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

    /// [`Store::evict_lru`] of `victims` (in order) in a pool shared with other hosts.
    fn evict_shared(&self, st: &mut Locked<'_>, victims: Vec<Victim>, want: u64) -> (u64, u64) {
        let (mut chosen, mut sizes) = (Vec::new(), Vec::new());
        let mut planned = 0;
        for v in victims {
            if planned >= want {
                break;
            }
            planned += v.frees;
            sizes.push(v.frees);
            chosen.push(Found::of(st, &st.entries[&v.ino]));
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

/// An entry eviction may remove: where its bytes are, as eviction weighs them.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    ino: u64,
    /// Its pool and pack, when it is a piece of one.
    pack: Option<(PoolIdx, u32)>,
    /// The bytes it holds in its pool.
    asize: u64,
}

impl Candidate {
    fn of(e: &Entry) -> Candidate {
        Candidate {
            ino: e.ino(),
            pack: e.place().packed().map(|(pack, _)| (e.pool(), pack)),
            asize: e.asize(),
        }
    }
}

/// One removal an eviction makes, and the bytes it gives back to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Victim {
    ino: u64,
    /// Its own bytes, or, for the last entry of a pack to go, the pack's; nothing for the
    /// others of a pack.
    frees: u64,
}

/// The order in which eviction removes `candidates` (the unprotected entries, least recently
/// used first), and what each removal frees; `pack` says what holds a pack's memory. An entry
/// with bytes of its own comes in its place. A packed entry's bytes come back only with its
/// pack's file, once nothing lives in the pack: a pack whose every entry is a candidate and
/// that takes no more allocations goes whole, in the place of its most recently used entry
/// (a pack is as recent as its most recent entry), its entries in their order. The entries
/// of a pack that something else keeps (a pinned, held or leased entry, an allocation, its
/// session still carving from it) are passed by: removing them would free nothing.
fn victims(candidates: &[Candidate], pack: impl Fn(PoolIdx, u32) -> Option<Usage>) -> Vec<Victim> {
    let mut packs: HashMap<(PoolIdx, u32), Vec<u64>> = HashMap::default();
    for c in candidates {
        if let Some(p) = c.pack {
            packs.entry(p).or_default().push(c.ino);
        }
    }
    let mut out = Vec::with_capacity(candidates.len());
    for c in candidates {
        let Some(p) = c.pack else {
            out.push(Victim {
                ino: c.ino,
                frees: c.asize,
            });
            continue;
        };
        let members = &packs[&p];
        if members.last() != Some(&c.ino) {
            continue; // not its pack's most recent entry
        }
        if let Some(u) = pack(p.0, p.1)
            && !u.open
            && u.live as usize == members.len()
        {
            out.extend(members.iter().map(|&ino| Victim { ino, frees: 0 }));
            out.last_mut().expect("a pack of candidates has one").frees = u.bytes;
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn c(ino: u64, pack: Option<u32>) -> Candidate {
        Candidate {
            ino,
            pack: pack.map(|p| (PoolIdx::at(0), p)),
            asize: 4096,
        }
    }

    fn v(ino: u64, frees: u64) -> Victim {
        Victim { ino, frees }
    }

    #[test]
    fn packs_go_whole_in_the_place_of_their_most_recent_entry() {
        // Least recently used first. Pack 1 (2 entries, closed) goes whole where its second
        // entry is; pack 2 has a live entry that is not a candidate (held); pack 3 is open.
        let candidates = [
            c(1, Some(1)),
            c(2, None),
            c(3, Some(2)),
            c(4, Some(1)),
            c(5, Some(3)),
            c(6, None),
        ];
        let usage = |_: PoolIdx, pack: u32| {
            Some(Usage {
                live: if pack == 3 { 1 } else { 2 },
                open: pack == 3,
                bytes: 8192,
            })
        };
        assert_eq!(
            victims(&candidates, usage),
            [v(2, 4096), v(1, 0), v(4, 8192), v(6, 4096)]
        );
    }
}
