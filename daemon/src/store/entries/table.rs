//! The table of sealed entries: the only code that inserts, removes or renames an entry,
//! with its index slot, its namespace's accounting, its pool's and the LRU order.

use std::time::SystemTime;

use maru::Result;

use super::{Entry, Removal};
use crate::store::authority::{Authority, Placed};
use crate::store::ids::Place;
use crate::store::namespaces::Namespace;
use crate::store::state::{Invalidation, State};
use crate::store::stats::{Bytes, Counters};

/// At most this many removed entries' attributes are kept for handles still open on them.
const GONE: usize = 4096;

impl State {
    /// Files a sealed entry (its name already published at the authority): namespace, index
    /// slot, accounting, LRU.
    pub fn insert_entry(&mut self, mut e: Entry) {
        e.lru = self.lru.file(e.ino);
        let n = self.ns.get_mut(&e.ns).expect("the namespace exists");
        if n.index.needs_rebuild() {
            rebuild_index(n);
        }
        assert!(
            n.index.insert(&e.key, e.slot_view()),
            "the index has room after a rebuild"
        );
        n.entries.insert(e.key.clone(), e.ino);
        n.bytes += e.size;
        n.mtime = SystemTime::now();
        let ps = &mut self.pools[e.pool];
        ps.sealed_bytes += e.asize;
        ps.entries += 1;
        self.entries.insert(e.ino, e);
    }

    /// Takes entry `ino` out of its namespace, index, pool accounting and the LRU order
    /// (not out of its pool: see [`State::remove_entry`] and [`State::rename_entry`]).
    fn unfile(&mut self, ino: u64) -> Option<Entry> {
        let e = self.entries.remove(&ino)?;
        self.lru.remove(&e.lru);
        let n = self.ns.get_mut(&e.ns).expect("the namespace exists");
        n.entries.remove(&e.key);
        n.index.remove(&e.key);
        n.bytes -= e.size;
        n.mtime = SystemTime::now();
        let ps = &mut self.pools[e.pool];
        ps.sealed_bytes -= e.asize;
        ps.entries -= 1;
        Some(e)
    }

    /// Takes entry `ino`'s slot out of its namespace's index, the entry staying (another
    /// host's, whose removal waits here: `Store::unindex_removed`): clients find it there no
    /// more, nor serve themselves a mapping of it they kept.
    pub fn unindex(&mut self, ino: u64) {
        if let Some(e) = self.entries.get(&ino)
            && let Ok(n) = self.ns.get_mut(&e.ns)
        {
            n.index.remove(&e.key);
        }
    }

    /// Where sealed entry `e` is, as the authority knows it.
    pub fn placed<'a>(&'a self, e: &Entry) -> Placed<'a> {
        Placed {
            pool: self.pools[e.pool].pool.uuid(),
            place: e.place,
            size: e.size,
        }
    }

    /// Removes a sealed entry: removes its name at the authority (or forgets it, when another
    /// host removed it), drops it from its pool and returns the name the kernel must forget.
    /// Its space is freed unless clients map it, here (leases) or on other hosts (the
    /// authority says); another host's entry frees nothing here. Fails, changing nothing,
    /// when the authority cannot record the removal.
    pub fn remove_entry(
        &mut self,
        auth: &dyn Authority,
        counters: &Counters,
        ino: u64,
        how: Removal,
    ) -> Result<Option<Invalidation>> {
        let Some(e) = self.entries.get(&ino) else {
            return Ok(None);
        };
        let at = self.placed(e);
        let held = match how {
            Removal::Elsewhere => {
                auth.forget(&e.ns, &e.key);
                at.pool.is_some_and(|p| auth.held_elsewhere(p, at.offset()))
            }
            Removal::GaveWay { to } => {
                auth.gave_way(&e.ns, &e.key, to);
                at.pool.is_some_and(|p| auth.held_elsewhere(p, at.offset()))
            }
            Removal::Withdrawn { w, .. } => auth.unpublish(&e.ns, &e.key, e.ino, &at, Some(w))?,
            Removal::Deleted | Removal::Evicted => {
                auth.unpublish(&e.ns, &e.key, e.ino, &at, None)?
            }
        };
        let e = self.unfile(ino).expect("present");
        let evicted = matches!(
            how,
            Removal::Evicted | Removal::Withdrawn { evicted: true, .. }
        );
        if e.holds > 0 {
            // Deleting (or evicting, by hand) a held entry is allowed, as for a pinned one;
            // the holds go with it (another host's entry: recorded there too).
            for s in self.sessions.values_mut() {
                s.holds.remove(&ino);
            }
            if e.remote.is_some() {
                auth.unpin_for_clients(&[(e.ns.clone(), e.key.clone())]);
            }
        }
        if self.gone.len() > GONE {
            self.gone.clear();
        }
        self.gone.insert(ino, e.attr());
        if let Some(s) = e.owner.and_then(|o| self.sessions.get_mut(&o)) {
            s.used = s.used.saturating_sub(e.size);
        }
        counters.add_bytes(
            if evicted {
                Bytes::Evicted
            } else {
                Bytes::Deleted
            },
            e.size,
        );
        let ps = &mut self.pools[e.pool];
        if evicted {
            ps.evictions += 1;
        }
        let parent = self.ns.get(&e.ns).map_or(0, |n| n.ino);
        if let Some(id) = e.remote() {
            // Another host's entry: in a raw pool, an extent.
            if let Some(offset) = e.place.extent() {
                ps.pool.drop_remote(offset, e.asize);
            }
            if e.leases > 0 {
                // Clients here map it: its publisher must keep the extent until they let go.
                let at = Placed {
                    pool: ps.pool.uuid(),
                    place: e.place,
                    size: e.size,
                };
                auth.hold(id, &at);
                self.zombies.insert(e.ino, e.clone());
            }
        } else if !ps.pool.delete(&e.loc(), e.leases > 0 || held) {
            self.zombies.insert(e.ino, e.clone());
        }
        Ok(Some(Invalidation {
            parent,
            name: e.key,
            ino,
            by_kernel: false,
        }))
    }

    /// Moves sealed entry `ino` to `ns/key` (never over an existing name: the authority
    /// grants the new name first). Both namespaces' accounting and mtimes change.
    pub fn rename_entry(
        &mut self,
        auth: &dyn Authority,
        ino: u64,
        ns: &str,
        key: &str,
    ) -> Result<()> {
        let e = self.entries.get(&ino).expect("a sealed entry").clone();
        if e.withdrawing {
            return Err(maru::Error::NotFound(format!(
                "{}/{} (being deleted)",
                e.ns, e.key
            )));
        }
        auth.publish(ns, key, ino, &self.placed(&e))?;
        // The old name goes at the authority (its extent stays: the entry keeps it).
        let moved = match auth.unpublish(&e.ns, &e.key, ino, &self.placed(&e), None) {
            Err(err) => Err(err),
            Ok(_) => match self.move_entry(ino, ns, key) {
                Ok(()) => Ok(()),
                Err(err) => {
                    // Still under its old name here: the authority has it back.
                    if let Err(e2) = auth.publish(&e.ns, &e.key, ino, &self.placed(&e)) {
                        tracing::warn!(ns = %e.ns, key = %e.key, "a rename undone: {e2}");
                    }
                    auth.settled(&e.ns, &e.key);
                    Err(err)
                }
            },
        };
        if moved.is_err() {
            auth.release(ns, key, ino);
        }
        auth.settled(ns, key);
        moved
    }

    /// Moves sealed entry `ino` to `ns/key` here, the authority having granted the new name
    /// and dropped the old: its pool's record, its index slots, both namespaces' accounting
    /// and mtimes.
    pub fn move_entry(&mut self, ino: u64, ns: &str, key: &str) -> Result<()> {
        let e = &self.entries[&ino];
        let at = self.pools[e.pool].pool.rename(&e.loc(), ns, key)?;
        let mut moved = self.unfile(ino).expect("present");
        moved.ns = ns.to_owned();
        moved.key = key.to_owned();
        if let Some(at) = at {
            moved.place = at;
        }
        self.insert_entry(moved);
        Ok(())
    }

    /// Entry `ino`'s bytes moved to `at` in its pool (a packed entry left its pack): its
    /// index slot says so.
    pub fn relocate(&mut self, ino: u64, at: Place) {
        if let Some(mut e) = self.unfile(ino) {
            e.place = at;
            self.insert_entry(e);
        }
    }

    /// Writes entry `ino`'s flags (pinned, held) to its index slot.
    pub fn index_flags(&mut self, ino: u64) {
        let Some(e) = self.entries.get(&ino) else {
            return;
        };
        if let Ok(n) = self.ns.get_mut(&e.ns) {
            n.index.set_flags(&e.key, e.flags());
        }
    }

    /// Gives back one lease on entry (or removed entry) `ino`. The last lease on a removed
    /// entry frees its extent, unless other hosts still map it; on another host's entry, it
    /// lets go of this host's hold.
    pub fn unlease(&mut self, auth: &dyn Authority, ino: u64, n: u32) {
        if let Some(e) = self.entries.get_mut(&ino) {
            e.leases = e.leases.saturating_sub(n);
            if let (0, Some(id)) = (e.leases, e.remote()) {
                auth.idle_remote(id);
            }
            return;
        }
        let Some(z) = self.zombies.get_mut(&ino) else {
            return;
        };
        z.leases = z.leases.saturating_sub(n);
        if z.leases > 0 {
            return;
        }
        if let Some(id) = z.remote() {
            self.zombies.remove(&ino);
            auth.idle_remote(id);
            return;
        }
        let pool = &self.pools[z.pool].pool;
        if pool
            .uuid()
            .is_some_and(|p| z.place.extent().is_some_and(|o| auth.held_elsewhere(p, o)))
        {
            return;
        }
        let z = self.zombies.remove(&ino).expect("present");
        self.pools[z.pool].pool.free_extent(z.place);
    }

    /// Entry `ino`, readied for a client here ([`State::ready_remote`]), was not leased after
    /// all (its request failed, or read nothing). If it is another host's and no client here
    /// leases it, the authority is told that none uses it, as a last lease's release tells it
    /// ([`Authority::idle_remote`]): left marked used, a removal of it would make this host
    /// hold the extent from its publisher for the life of its lease.
    pub fn not_leased(&self, auth: &dyn Authority, ino: u64) {
        if let Some(e) = self.entries.get(&ino)
            && e.leases == 0
            && let Some(id) = e.remote()
        {
            auth.idle_remote(id);
        }
    }

    /// Frees the removed entry of this host at `offset` of raw pool `pool` that no host maps
    /// any more (the authority said so, naming the offset, not the removal), unless clients
    /// here still do, or the authority holds the offset again
    /// ([`Authority::held_elsewhere`]): the word comes late (the applier's queue, or an
    /// eviction's wait without the lock), and meanwhile the entry it was about may have gone
    /// with its last lease here, its extent carved again, published and removed; that later
    /// removal, held from before its entry was removed here, waits for a word of its own.
    pub fn free_unheld(&mut self, auth: &dyn Authority, pool: &str, offset: u64) {
        if auth.held_elsewhere(pool, offset) {
            return;
        }
        let found = self.zombies.iter().find(|(_, z)| {
            z.remote.is_none()
                && z.leases == 0
                && z.place == Place::Extent(offset)
                && self.pools[z.pool].pool.uuid() == Some(pool)
        });
        if let Some((&ino, _)) = found {
            let z = self.zombies.remove(&ino).expect("present");
            self.pools[z.pool].pool.free_extent(z.place);
        }
    }

    /// Gives namespace `ns` and every namespace under it a fresh index, retiring the old
    /// ones, after a change of `ns`'s access: a client that mapped one must ask for the new
    /// one, and marud checks its access again (an index shows every name and size as they
    /// change, to whoever maps it).
    pub fn renew_indexes(&mut self, ns: &str) {
        let under = format!("{ns}/");
        let names: Vec<String> = self
            .ns
            .iter()
            .filter(|(n, _)| *n == ns || n.starts_with(&under))
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let Ok(n) = self.ns.get_mut(&name) else {
                continue;
            };
            rebuild_index(n);
        }
    }
}

/// Replaces a namespace's index with a fresh table holding its live keys
/// ([`crate::nsindex::NsIndex::grown`]); the old one is retired and its memory given back
/// off the store's lock (clients map it until they see it retired).
fn rebuild_index(n: &mut Namespace) {
    match n.index.grown() {
        Ok(ix) => {
            ix.set_pending(n.pending);
            let old = std::mem::replace(&mut n.index, ix);
            let _ = std::thread::Builder::new()
                .name("maru-index".into())
                .spawn(move || drop(old));
        }
        Err(e) => tracing::error!("cannot grow a namespace index: {e}"),
    }
}
