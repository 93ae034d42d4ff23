//! Entries other hosts published (cluster mode): filed here from the cluster's watch, served
//! like any entry, never carved, freed or evicted here; and removed here when another host
//! removes them.

use std::sync::Arc;

use maru::name::{check_component, split_ns};
use maru::{Error, Result};

use super::Store;
use super::authority::{Authority, Gone};
use super::entries::Entry;
use super::entries::Removal;
use super::ids::Place;
use super::policy::Perm;
use super::state::{Invalidation, State};
use crate::alloc::align_up;
use crate::coherence::WriteBack;
use crate::pool::ENTRY_ALIGN;

/// Lines of another host's entry this host's caches may hold stale (a pool without coherence
/// across hosts), to drop before the entry's first read here ([`State::ready_remote`]).
pub struct Stale {
    ino: u64,
    lines: Arc<WriteBack>,
    offset: u64,
    size: u64,
}

/// Another host's entry this host serves ([`Store::remote_entries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteEntry {
    pub ns: String,
    pub key: String,
    /// The authority's revision that created it.
    pub created: i64,
    /// Its extent in the shared raw pool: offset and size.
    pub offset: u64,
    pub size: u64,
}

impl Store {
    /// Files `ns/key`, which another host published at `offset` (`size` bytes) of the raw
    /// pool whose device header says `pool_uuid`: this host serves it from then on (index,
    /// mount, retrievals) and never carves, frees or evicts its extent. A name this host
    /// holds already is left alone (the authority keeps names write-once across hosts);
    /// false, filing nothing, when that entry is being withdrawn here (the authority holds
    /// the change back until the store has settled the name, and the caller asks it to).
    pub fn file_remote(
        &self,
        pool_uuid: &str,
        ns: &str,
        key: &str,
        offset: u64,
        size: u64,
        created: i64,
    ) -> Result<bool> {
        split_ns(ns)?;
        check_component(key.as_bytes())?;
        let mut st = self.lock();
        let pool = st
            .pools
            .iter()
            .find(|p| p.pool.uuid() == Some(pool_uuid))
            .map(|p| p.id)
            .ok_or_else(|| Error::NotFound(format!("no pool with UUID {pool_uuid}")))?;
        if let Some(ino) = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied()) {
            return Ok(!st.entries[&ino].withdrawing());
        }
        st.ensure_ns_here(ns)?;
        if st.ns.get(ns)?.children.contains_key(key) {
            return Err(Error::Exists(format!("{ns}/{key} is a namespace here")));
        }
        st.pools[pool]
            .pool
            .adopt_remote(offset, align_up(size.max(1), ENTRY_ALIGN))?;
        let ino = st.alloc_ino();
        self.authority.adopt(ns, key, ino);
        let root = Perm {
            uid: 0,
            gid: 0,
            mode: 0o644,
        };
        st.insert_entry(
            Entry::new(ino, ns, key, pool, Place::Extent(offset), size, root)
                .published_elsewhere(created),
        );
        let parent = st.ns.get(ns)?.ino;
        drop(st);
        // The kernel may cache the name as absent: make it look again.
        self.notify(vec![Invalidation {
            parent,
            name: key.to_owned(),
            ino,
            by_kernel: false,
        }]);
        Ok(true)
    }

    /// Removes `ns/key` here because another host removed it: this host's entry of the
    /// name or another host's, as `gone` says (a newer entry of the name stays). False, doing
    /// nothing, when the name's entry here is being withdrawn (deleted or renamed here: the
    /// authority holds the change back until the store has settled the name, and the caller
    /// asks it to).
    pub fn forget_remote(&self, ns: &str, key: &str, gone: Gone) -> bool {
        let mut st = self.lock();
        let which = |e: &Entry| match gone {
            Gone::Own => e.remote().is_none(),
            Gone::Remote(created) => e.remote().is_some_and(|r| r.created == created),
        };
        let removed = self.remove_as_elsewhere(&mut st, ns, key, which, Removal::Elsewhere);
        let Some(inv) = removed else {
            return false;
        };
        drop(st);
        self.notify(inv.into_iter().collect());
        true
    }

    /// Removes the entry of `ns/key` here, if `which` says it is the one, as a removal by
    /// another host does (`how`: asking nothing of the authority, it cannot fail); its
    /// invalidation. None, doing nothing, when the entry is being withdrawn here.
    fn remove_as_elsewhere(
        &self,
        st: &mut State,
        ns: &str,
        key: &str,
        which: impl FnOnce(&Entry) -> bool,
        how: Removal,
    ) -> Option<Option<Invalidation>> {
        let Some(ino) = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied()) else {
            return Some(None);
        };
        let e = &st.entries[&ino];
        if e.withdrawing() {
            return None;
        }
        if !which(e) {
            return Some(None);
        }
        Some(
            st.remove_entry(&*self.authority, &self.counters, ino, how)
                .ok()
                .flatten(),
        )
    }

    /// Another host's entry of `ns/key` filed here before the authority granted this host's
    /// publication of the name gives way to it. Write-once: the grant says etcd held no entry
    /// of the name then, so that one was removed, and its removal, held back while this host
    /// changes the name, is still on its way (seed 1985: refused for it, a granted
    /// publication had its extent freed while etcd kept its record, and the other hosts read
    /// the next entry's bytes under its name). Removed here as that removal will remove it
    /// ([`Store::forget_remote`]), which then finds this host's entry and leaves it; the
    /// name stays this host's publication `id` at the authority (forgotten, this host would
    /// ask no removal of it when it deletes it, and free its extent while etcd kept the
    /// record). One being withdrawn here (deleted or renamed) stays.
    pub(super) fn give_way(
        &self,
        st: &mut State,
        ns: &str,
        key: &str,
        id: u64,
    ) -> Option<Invalidation> {
        let inv = self
            .remove_as_elsewhere(
                st,
                ns,
                key,
                |e| e.remote().is_some(),
                Removal::GaveWay { to: id },
            )
            .flatten()?;
        tracing::debug!(
            ns,
            key,
            "another host's entry gave way to a publication granted here"
        );
        Some(inv)
    }

    /// Drops the stale lines `ready_remote` gave, without the store's lock (an entry of a GiB
    /// is 16 million lines), then marks the entry read here: readers from then on skip it.
    /// Readers that found it cold meanwhile drop them too, each before it answers (twice
    /// is harmless).
    pub(super) fn drop_stale(&self, stale: Option<Stale>) {
        let Some(s) = stale else {
            return;
        };
        s.lines.invalidate(s.offset, s.size);
        if let Some(e) = self.lock().entries.get_mut(&s.ino) {
            e.set_warm();
        }
    }

    /// Frees this host's removed entry at `offset` of raw pool `pool`, which no other host
    /// maps any more (unless clients here still do: then their last release frees it; or a
    /// later removal at that offset is held: [`State::free_unheld`]).
    pub fn free_unheld(&self, pool: &str, offset: u64) {
        self.lock().free_unheld(&*self.authority, pool, offset);
    }

    /// Sets (or clears) namespace `ns`'s quota here because a host sharing the authority did
    /// (nothing is asked); the namespace is created if this host has none of that name.
    pub fn quota_elsewhere(&self, ns: &str, bytes: Option<u64>) {
        let mut st = self.lock();
        let set = split_ns(ns)
            .and_then(|_| st.ensure_ns_here(ns))
            .and_then(|()| {
                st.ns.get_mut(ns)?.quota = self.authority.quota(ns).unwrap_or(bytes);
                Ok(())
            });
        match set {
            Ok(()) => st.ns.save(),
            Err(e) => tracing::warn!(ns, "a quota set on another host: {e}"),
        }
    }

    /// Pins or unpins `ns/key` here because a host sharing the authority did (nothing is
    /// asked); an entry not here is left alone.
    pub fn pin_elsewhere(&self, ns: &str, key: &str, pinned: bool) {
        let mut st = self.lock();
        let Some(ino) = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied()) else {
            return;
        };
        let pinned = self.authority.pinned(ns, key).unwrap_or(pinned);
        if let Err(e) = st.mark_pinned(ino, pinned) {
            tracing::warn!(ns, key, "recording a pin of another host: {e}");
        }
    }

    /// Marks this host's entry `ns/key` as pinned (or no longer) by clients of other hosts:
    /// it is not evicted while it is.
    pub fn client_pin_elsewhere(&self, ns: &str, key: &str, pinned: bool) {
        let mut st = self.lock();
        let Some(ino) = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied()) else {
            return;
        };
        if let Some(e) = st.entries.get_mut(&ino) {
            e.set_pinned_elsewhere(pinned);
            st.index_flags(ino);
        }
    }

    /// Makes this host's entries that other hosts used (their batched reports, oldest use
    /// first) the most recently used here, where they are evicted.
    pub fn used_elsewhere(&self, used: &[(String, String)]) {
        let mut st = self.lock();
        for (ns, key) in used {
            let ino = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied());
            if let Some(ino) =
                ino.filter(|i| st.entries.get(i).is_some_and(|e| e.remote().is_none()))
            {
                st.touch(ino);
            }
        }
    }

    /// The entries other hosts published that this host serves.
    pub fn remote_entries(&self) -> Vec<RemoteEntry> {
        let st = self.lock();
        st.entries
            .values()
            .filter_map(|e| {
                Some(RemoteEntry {
                    ns: e.ns().to_owned(),
                    key: e.key().to_owned(),
                    created: e.remote()?.created,
                    offset: st.placed(e).offset(),
                    size: e.size(),
                })
            })
            .collect()
    }

    /// Another host removed entry `ns/key` (`removed`: this host's publication of the name,
    /// or another host's entry created at that revision), and the removal waits here for a
    /// change of the name to settle: the entry leaves the index at once, so that no client
    /// serves itself a mapping of it it kept (the extent may be carved again already: removed
    /// while this host was cut off, the removal waited for no acknowledgement of this host's,
    /// and another host's entry's publisher, or the host that took a region of this one's
    /// during the cut, may carve it). marud refuses it to new readers meanwhile
    /// ([`Authority::use_remote`], [`Authority::own_removed`]); it goes for good once the
    /// removal applies.
    pub fn unindex_removed(&self, ns: &str, key: &str, removed: Gone) {
        let mut st = self.lock();
        let Some(ino) = st.ns.get(ns).ok().and_then(|n| n.entries.get(key).copied()) else {
            return;
        };
        let remote = st.entries[&ino].remote();
        let that = match removed {
            Gone::Own => remote.is_none(),
            Gone::Remote(created) => remote.is_some_and(|r| r.created == created),
        };
        if that {
            st.unindex(ino);
        }
    }
}

impl State {
    /// Creates namespace `ns` (and those above it) here if absent, as another host's entry or
    /// quota needs it: owned by root, mode 0755.
    pub(super) fn ensure_ns_here(&mut self, ns: &str) -> Result<()> {
        let existed = self.ns.contains(ns);
        let mut next = self.next_ino;
        let made = self.ns.ensure_path(ns, || {
            next += 1;
            next - 1
        });
        self.next_ino = next;
        made?;
        for p in &mut self.pools {
            p.pool.ensure_ns(ns)?;
        }
        if !existed {
            // Made here, with those above it that were missing: their directories take
            // their access (a parent's again, harmlessly, where it existed).
            let prefixes = ns.match_indices('/').map(|(i, _)| &ns[..i]);
            for prefix in prefixes.chain([ns]) {
                self.mirror_ns_access(prefix);
            }
        }
        self.ns.save();
        Ok(())
    }

    /// Marks entry `ino` pinned or not here: its flag, its index slot, and (this host's own
    /// entries) its pool's record.
    pub fn mark_pinned(&mut self, ino: u64, pinned: bool) -> Result<()> {
        let e = self
            .entries
            .get_mut(&ino)
            .ok_or_else(|| Error::NotFound("entry".into()))?;
        if e.pinned() == pinned {
            return Ok(());
        }
        if e.remote().is_none() {
            self.pools[e.pool()].pool.set_pinned(&e.loc(), pinned)?;
        }
        e.set_pinned(pinned);
        self.index_flags(ino);
        Ok(())
    }

    /// Whether entry `ino` lies in the shared pool while this host is fenced off it
    /// (`fenced`: [`Authority::fenced`], asked once per request): cut off from the cluster
    /// long enough for another host to have carved its extent again (after a removal this
    /// host never heard of), so it is not served until this host has rejoined and caught up.
    pub fn fenced_off(&self, fenced: bool, ino: u64) -> bool {
        fenced
            && self
                .entries
                .get(&ino)
                .is_some_and(|e| self.pools[e.pool()].pool.leases())
    }

    /// Readies entry `ino` for a client of this host to map or read (the caller then counts a
    /// lease on it), if another host published it: tells the authority, which answers false
    /// when the entry's removal has arrived (None: the caller answers as if it were absent)
    /// and otherwise makes this host hold the extent should the removal arrive while clients
    /// here map it ([`Authority::use_remote`]); notes the use for its publisher's LRU order;
    /// and before the first read here, on a pool without coherence across hosts, gives the
    /// stale cache lines of it the caller drops without the lock, before it answers
    /// ([`Store::drop_stale`]). No round trip. This host's own entries need nothing.
    pub fn ready_remote(&mut self, auth: &dyn Authority, ino: u64) -> Option<Option<Stale>> {
        let Some(e) = self.entries.get_mut(&ino) else {
            return Some(None);
        };
        let Some(id) = e.remote() else {
            // This host's own, removed by another host while the removal is held back here:
            // its extent may be carved again (seed 2423).
            let shared = self.pools[e.pool()].pool.leases();
            return (!shared || !auth.own_removed(e.ns(), e.key())).then_some(None);
        };
        if !auth.use_remote(id) {
            return None;
        }
        auth.accessed(e.ns(), e.key());
        if !e.cold() {
            return Some(None);
        }
        let (pool, offset, size) = (e.pool(), e.place().wire(), e.size());
        match self.pools[pool].pool.write_back() {
            Some(lines) => Some(Some(Stale {
                ino,
                lines,
                offset,
                size,
            })),
            None => {
                e.set_warm(); // coherent: nothing stale
                Some(None)
            }
        }
    }
}
