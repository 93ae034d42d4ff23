//! The store: namespaces, entries, allocations, sessions, eviction and persistence over a
//! set of pools, behind one lock that guards the metadata (bytes never pass through it:
//! clients map them). This file is the facade and the control socket's verbs; each job has
//! its module:
//!
//! - [`state`]: the types the lock guards (allocations' origin and backing are enums);
//! - [`namespaces`]: the tree, modes, quotas and their persistence;
//! - [`entries`]: the entry, whose fields only it writes (they are private to it), and the
//!   only code that inserts, removes or renames one;
//! - [`lru`]: the least-recently-used order; [`placement`]: pools and eviction;
//! - [`pools`]: the pool trait and its memfs and raw implementations;
//! - [`sessions`]: client sessions and leases; [`stats`]: counters as atomics;
//! - [`policy`]: the access policy both doors ask; [`authority`]: who owns a name and
//!   each region of a raw pool;
//! - [`publishing`]: a client's publications, in three steps; `deletion`: deletes and pins,
//!   likewise;
//! - `writer`: a writer through the mount's life, the only code that changes its bookkeeping;
//! - [`fsview`]: the mount's view (the filesystem's `Backend`), including the publication
//!   of entries written through the mount;
//! - [`remote`]: entries other hosts published (cluster mode).
//! - `seams`: the crash- and fault-injection seams of the daemon's own tests (feature
//!   `seams` only).
//!
//! **The lock's rule.** The lock guards metadata and nothing else: while it is held, no
//! system call that can take long (an `fallocate` of a client's allocation, a `/proc` read,
//! an `fsync`, a read of entry bytes) and no network round trip. A verb reserves under the
//! lock, does the slow part with it released, and commits under it again, with a failure
//! path that puts back what it reserved. Done that way: a client's allocation (a memfs file
//! of its own is made outside the lock: [`pools::Prepare`], [`Store::alloc`]), the pages a
//! `truncate` or `fallocate` through the mount reserves for an entry being written (one size
//! change per entry at a time, under its own guard), the mount's reads (of sealed entries,
//! a raw pool's extent leased meanwhile; of entries being written), and the statistics
//! (`/proc/meminfo` is read before the lock), and in cluster mode a client's publications,
//! deletes and pins (their etcd round trips, group-committed: [`publishing`], `deletion`),
//! and the mount's publications (the name's reservation at a writer's close, the publication
//! at its release: the writer is marked as asking meanwhile, `writer`), unlinks and renames
//! (the entry marked as withdrawing meanwhile; the applier leaves such an entry alone), and
//! an eviction's removals and its wait for the other hosts' acknowledgements (`placement`),
//! and the claim of each region a raw pool carves (`Pool::unclaimed`, `Store::claim`), and
//! for a raw pool the bytes written through the mount (up to `max_copy_entry`): each
//! write, read and size change of them under their buffer's own lock, and their copy into
//! the pool at a writer's close and before its publication with the writer marked as copying
//! ([`pools::buffer`], `Store::copy_in`), and on a pool without coherence across hosts the
//! write-back of a published entry's lines (before its publication is asked for,
//! [`crate::coherence::WriteBack`]) and a reader's invalidation of another host's entry
//! before its first read here (`Store::drop_stale`), and with `--wal-sync` the sync of each
//! record of a pool's log: written under the lock, synced once the lock is let go, before
//! the verb answers, with the records of other clients waiting then ([`locked`],
//! [`crate::wal::Syncer`]); a removed extent is freed once its removal's record is synced.
//! The one exception: a log's rewrite, made off the lock, is swapped in under it, and the
//! records appended while it ran are synced in the new file first (once per
//! [`crate::wal::REWRITE_AFTER`] records). A client's first hold of another host's entry is
//! recorded at the authority for its publisher with the lock let go of, the entry marked
//! meanwhile so that other holds of it wait for the outcome (`Store::hold`). The lock is
//! taken only through [`Locked`], which knows whether this thread holds it: the waits for a
//! log's sync, a memfs allocation's `fallocate`, a wait for etcd's commit, a region's claim,
//! an eviction's wait for the other hosts and every wait on the cluster's runtime check
//! that it does not ([`assert_unlocked`], in debug builds: every test).

pub mod authority;
mod deletion;
mod entries;
pub mod fsview;
mod hashmap;
pub mod ids;
mod locked;
mod lru;
mod mount_writers;
mod namespaces;
mod placement;
mod policy;
pub mod pools;
pub mod publishing;
mod readers;
mod recovery;
mod remote;
mod seams;
mod sessions;
mod settings;
mod state;
mod stats;
mod writer;

use std::fs::File;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use locked::Locked;
use maru::name::split_ns;
use maru::proto::{ClientInfo, Grant, Located, NsInfo, PoolInfo, PoolKind, Stats};
use maru::{Error, Result};
use maru_fsd::Caller;
use parking_lot::{Condvar, Mutex};

use crate::alloc::align_up;
use crate::pool::{ENTRY_ALIGN, PoolSpec};
use authority::{Authority, LocalAuthority};
pub use ids::{PoolIdx, SessionId, SharedId};
pub use locked::{assert_unlocked, held_here, take_sync_failure};
use namespaces::{join, parent};
use policy::{Access, Perm};
use pools::{Backing, Requester};
pub use settings::{Eviction, StoreConfig};
pub use state::Invalidation;
use state::{Alloc, Origin, State};
use stats::Counters;

/// Per key of a retrieve: where the entry is and the descriptor to send (if any).
pub type Retrieved = Vec<Option<(Located, Option<File>)>>;

/// Hook for the mount: names the kernel must forget (from any thread, asynchronously).
pub type InvalidateFn = Box<dyn Fn(Invalidation) + Send + Sync>;

/// Decides whether a write into the entry being written `ino` fails, and with which errno
/// (tests: a device error in the middle of a store; feature `seams`).
#[cfg(feature = "seams")]
pub type DataFault = Box<dyn Fn(u64) -> Option<i32> + Send + Sync>;

/// Called with each name a shared authority answered for, before the store takes its lock
/// again to finish: `"published"` (a client's publication granted, to be sealed),
/// `"withdrawn"` (a delete's removal recorded, the entry to be removed) or `"reserved"` (a
/// committed mount writer's new name, renamed, reserved). Tests: what happens meanwhile;
/// feature `seams`.
#[cfg(feature = "seams")]
pub type AskGate = Box<dyn Fn(&str, &str, &str) + Send + Sync>;

/// What the store reports of a door that serves it to other hosts (marud's remote door, which
/// keeps its own counters): read when statistics are asked for, never on a request's path.
pub trait RemoteView: Send + Sync {
    /// The door, its counters and its connected workers, now.
    fn info(&self) -> maru::proto::RemoteInfo;
}

/// A page of a namespace's listing ([`Store::list`]): the namespace (not the root), its
/// children, its entries, and whether names remain after them.
pub type NsListing = (Option<NsInfo>, Vec<NsInfo>, Vec<Located>, bool);

/// The store.
pub struct Store {
    cfg: StoreConfig,
    st: Mutex<State>,
    /// Per pool, what its grants do without the lock (see [`Store::place`]).
    preparers: Vec<Option<Arc<dyn pools::Prepare>>>,
    authority: Arc<dyn Authority>,
    counters: Counters,
    invalidate: Mutex<Option<Arc<InvalidateFn>>>,
    started: Instant,
    /// Signalled when an entry written through the mount is sealed or dropped, and when the
    /// record of a first hold of another host's entry has its outcome.
    sealed: Condvar,
    /// The fault-injection seam of writes through the mount (tests, feature `seams`).
    #[cfg(feature = "seams")]
    data_fault: parking_lot::RwLock<Option<DataFault>>,
    /// The seam between a shared authority's answer and the store's next step (tests,
    /// feature `seams`).
    #[cfg(feature = "seams")]
    ask_gate: parking_lot::RwLock<Option<AskGate>>,
    /// The remote door, once it is open (reported in [`Store::stats`]).
    remote: OnceLock<Arc<dyn RemoteView>>,
    /// Held by a pin or unpin across its steps (see `deletion`): pins change in the order
    /// the authority recorded them.
    pins: Mutex<()>,
}

impl Store {
    /// Opens every pool, recovers their entries and the namespaces.
    pub fn open(cfg: StoreConfig, specs: &[PoolSpec]) -> anyhow::Result<Arc<Self>> {
        Self::open_with(cfg, specs, Arc::new(LocalAuthority::default()))
    }

    /// [`Store::open`] with the metadata authority `authority`.
    pub fn open_with(
        cfg: StoreConfig,
        specs: &[PoolSpec],
        authority: Arc<dyn Authority>,
    ) -> anyhow::Result<Arc<Self>> {
        let st = recovery::open_state(&cfg, specs, &authority)?;
        let preparers = st.pools.iter().map(|p| p.pool.preparer()).collect();
        Ok(Arc::new(Store {
            cfg,
            preparers,
            st: Mutex::new(st),
            authority,
            counters: Counters::default(),
            invalidate: Mutex::new(None),
            started: Instant::now(),
            sealed: Condvar::new(),
            #[cfg(feature = "seams")]
            data_fault: parking_lot::RwLock::new(None),
            #[cfg(feature = "seams")]
            ask_gate: parking_lot::RwLock::new(None),
            remote: OnceLock::new(),
            pins: Mutex::new(()),
        }))
    }

    /// Tells the store of the remote door, whose view its statistics then include (once: a
    /// second door is ignored).
    pub fn set_remote(&self, door: Arc<dyn RemoteView>) {
        if self.remote.set(door).is_err() {
            tracing::warn!("a second remote door's statistics are not reported");
        }
    }

    /// Registers the mount's invalidation hook.
    pub fn set_invalidate(&self, f: Option<InvalidateFn>) {
        *self.invalidate.lock() = f.map(Arc::new);
    }

    fn notify(&self, inv: Vec<Invalidation>) {
        if inv.is_empty() {
            return;
        }
        let f = self.invalidate.lock().clone();
        if let Some(f) = f {
            for i in inv {
                f(i);
            }
        }
    }

    /// Counts one control request (shown in stats and metrics).
    pub fn count(&self, op: &str) {
        self.counters.count(op);
    }

    /// Records the latency of one control request.
    pub fn record_latency(&self, op: &str, d: Duration) {
        self.counters.record_latency(op, d);
    }

    /// Decides `access` by `c` in namespace `ns` (the policy, over `ns`'s path).
    fn allow(st: &State, c: &Caller, ns: &str, access: Access<'_>) -> Result<()> {
        policy::check(c, &st.ns.chain(ns), ns, access)
    }

    // ----- namespaces -----

    /// Creates namespace `ns`.
    pub fn mkdir(&self, c: &Caller, ns: &str, mode: u32) -> Result<u64> {
        split_ns(ns)?;
        let mut st = self.lock();
        if st.ns.contains(ns) {
            return Err(Error::Exists(format!("namespace `{ns}`")));
        }
        let (p, name) = parent(ns);
        let pn = st.ns.get(p)?;
        Self::allow(&st, c, p, Access::Create)?;
        if pn.entries.contains_key(name) || pn.writing.contains_key(name) {
            return Err(Error::Exists(format!("`{ns}` is an entry")));
        }
        let ino = st.alloc_ino();
        let perm = Perm {
            uid: c.uid,
            gid: c.gid,
            mode,
        };
        st.ns.insert(ns, ino, perm)?;
        for p in &mut st.pools {
            p.pool.ensure_ns(ns)?;
        }
        st.mirror_ns_access(ns);
        st.ns.save();
        Ok(ino)
    }

    /// Removes the empty namespace `ns`.
    pub fn rmdir(&self, c: &Caller, ns: &str) -> Result<()> {
        split_ns(ns)?;
        let mut st = self.lock();
        let n = st.ns.get(ns)?;
        let perm = n.perm;
        let empty = n.is_empty();
        Self::allow(&st, c, parent(ns).0, Access::Delete(&perm))?;
        if !empty {
            return Err(Error::NotEmpty(format!("namespace `{ns}`")));
        }
        st.ns.remove(ns);
        for p in &mut st.pools {
            p.pool.remove_ns(ns);
        }
        st.ns.save();
        Ok(())
    }

    /// Sets or clears a namespace's quota (root only). Entries already stored stay; stores
    /// that would go over it fail with [`Error::Quota`].
    /// The authority records it first, without the store's lock.
    pub fn set_quota(&self, c: &Caller, ns: &str, bytes: Option<u64>) -> Result<()> {
        split_ns(ns)?;
        {
            let st = self.lock();
            Self::allow(&st, c, ns, Access::SetQuota)?;
            st.ns.get(ns)?;
        }
        self.authority.set_quota(ns, bytes)?;
        let mut st = self.lock();
        // Removed meanwhile: the quota holds for the namespace of that name made again.
        st.ensure_ns_here(ns)?;
        st.ns.get_mut(ns)?.quota = self.authority.quota(ns).unwrap_or(bytes);
        st.ns.save();
        Ok(())
    }

    // ----- allocation and publication (libmaru) -----

    /// Grants `count` allocations of `size` bytes to a session, to be published in `ns` if the
    /// client said so. memfs grants carry the file (or the pack) they are in.
    pub fn alloc(
        &self,
        session: SessionId,
        size: u64,
        count: u32,
        pool: Option<&str>,
        ns: Option<&str>,
    ) -> Result<Vec<(Grant, Option<Arc<File>>)>> {
        if size == 0 {
            return Err(Error::InvalidArgument("size must be > 0".into()));
        }
        if let Some(ns) = ns {
            split_ns(ns)?;
        }
        if count == 0 || count as usize > maru::proto::MAX_FDS_PER_FRAME {
            return Err(Error::InvalidArgument(format!(
                "count must be 1..={}",
                maru::proto::MAX_FDS_PER_FRAME
            )));
        }
        if self.authority.fenced() {
            return Err(authority::fenced_error());
        }
        let mut st = self.lock();
        let hint = match pool {
            Some(name) => Some(
                st.pools
                    .iter()
                    .find(|p| p.name == name)
                    .map(|p| p.id)
                    .ok_or_else(|| Error::InvalidArgument(format!("no pool named `{name}`")))?,
            ),
            None => None,
        };
        let too_big = |p: &state::PoolSlot| size > p.pool.capacity();
        if hint.is_some_and(|h| too_big(&st.pools[h])) || st.pools.iter().all(too_big) {
            return Err(Error::NoSpace(format!(
                "{} exceed the capacity of {}",
                maru::size::format_size(size),
                if hint.is_some() {
                    "the pool"
                } else {
                    "every pool"
                }
            )));
        }
        let caller = st.caller(session)?;
        let perm = Perm {
            uid: caller.uid,
            gid: caller.gid,
            mode: 0o644,
        };
        let who = Requester {
            session: Some(session),
            ns,
            perm: &perm,
        };
        let mut out = Vec::with_capacity(count as usize);
        let mut err = None;
        for _ in 0..count {
            let id = st.alloc_ino();
            // `place` lets the lock go while it makes a large memfs file.
            let (p, backing) = match self.place(&mut st, &who, id, size, hint) {
                Ok(placed) => placed,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            };
            if !st.sessions.contains_key(&session) {
                // The client left while its allocation was made: nothing of it stays.
                st.pools[p].pool.abort(id, &backing);
                err = Some(Error::InvalidArgument(format!("session {session} ended")));
                break;
            }
            let acct = align_up(size, ENTRY_ALIGN);
            st.pools[p].writing_bytes += acct;
            // The descriptor the client maps, and where in it the allocation is.
            let (offset, file, pack) = match &backing {
                Backing::File { file, .. } => (0, Some(file.clone()), None),
                Backing::Packed {
                    pack, offset, file, ..
                } => (*offset, Some(file.clone()), Some(*pack)),
                Backing::Extent { offset } => (*offset, None, None),
                Backing::Buffer { .. } => (0, None, None),
            };
            st.allocs.insert(
                id,
                Alloc {
                    pool: p,
                    size,
                    origin: Origin::Session(session),
                    backing,
                    perm,
                    mtime: SystemTime::now(),
                    acct,
                },
            );
            st.sessions
                .get_mut(&session)
                .expect("checked")
                .allocs
                .insert(id);
            let grant = Grant {
                alloc: id,
                pool: p.get(),
                offset,
                size,
                fd: file.is_some(),
                pack,
                until: self.write_fence(&st, p),
            };
            out.push((grant, file));
        }
        drop(st);
        match (out.is_empty(), err) {
            (true, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }

    /// Until when a client may begin writing into what pool `p` granted (cluster mode, on
    /// the shared pool: see [`Authority::fence`]).
    fn write_fence(&self, st: &State, p: PoolIdx) -> Option<u64> {
        self.authority.fence().filter(|_| st.pools[p].pool.leases())
    }

    /// Sets until when clients may trust the namespaces' indexes (cluster mode: the
    /// authority's fence, as it stood a moment ago, so never later than it).
    pub fn set_fence(&self, until: u64) {
        self.lock().ns.set_fence(until);
    }

    /// Gives allocations back.
    pub fn free(&self, session: SessionId, ids: &[u64]) -> Result<()> {
        let mut st = self.lock();
        for id in ids {
            if st.allocs.get(id).and_then(Alloc::session) != Some(session) {
                return Err(Error::InvalidArgument(format!(
                    "allocation {id} is not yours"
                )));
            }
            if let Some(s) = st.sessions.get_mut(&session) {
                s.allocs.remove(id);
            }
            self.drop_alloc(&mut st, *id);
        }
        Ok(())
    }

    /// Drops an allocation that will not be published (and its name's reservation).
    fn drop_alloc(&self, st: &mut State, id: u64) {
        if let Some((ns, key)) = st.writer_left(id) {
            self.authority.release(&ns, &key, id);
        }
        let Some(a) = st.allocs.remove(&id) else {
            return;
        };
        let ps = &mut st.pools[a.pool];
        ps.writing_bytes -= a.acct;
        ps.pool.abort(id, &a.backing);
    }

    // ----- retrieval and the other verbs -----

    /// A descriptor of raw pool `pool` for a session's grants (`write`) or retrievals.
    pub fn raw_pool_fd(&self, pool: u32, write: bool) -> Result<File> {
        let st = self.lock();
        let p = st
            .pools
            .get(pool as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("no pool {pool}")))?;
        p.pool.device_fd(write)
    }

    /// Which keys exist.
    pub fn exists(&self, c: &Caller, ns: &str, keys: &[String]) -> Result<Vec<bool>> {
        split_ns(ns)?;
        let mut st = self.lock();
        self.wait_imminent(&mut st, ns, keys);
        Self::allow(&st, c, ns, Access::Lookup)?;
        let n = st.ns.get(ns)?;
        let fenced = self.authority.fenced();
        Ok(keys
            .iter()
            .map(|k| {
                n.entries
                    .get(k)
                    .is_some_and(|&ino| !st.fenced_off(fenced, ino))
            })
            .collect())
    }

    /// Waits (at most a second) while any of `keys` is about to be published through the
    /// mount (its writer's close committed it; the kernel's release is on its way).
    fn wait_imminent(&self, st: &mut Locked<'_>, ns: &str, keys: &[String]) {
        self.wait_while(st, |st| {
            keys.iter().any(|k| publication_imminent(st, ns, k))
        });
    }

    /// Waits (at most a second) while `pending` holds, woken at each publication.
    /// Waits (a second at most) for the authority's answer to the writer of `ns/name`, if it
    /// is asking (its close's reservation or publication, or a rename's); `EBUSY` when it
    /// has not come: an unlink or a rename made meanwhile would be undone by that answer, or
    /// leave its record at the authority with nothing behind it.
    fn wait_for_asked(&self, st: &mut Locked<'_>, ns: &str, name: &str) -> Result<()> {
        self.wait_while(st, |st| publication_asked(st, ns, name));
        if publication_asked(st, ns, name) {
            return Err(Error::from_errno(libc::EBUSY)); // still at the authority
        }
        Ok(())
    }

    fn wait_while(&self, st: &mut Locked<'_>, pending: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(1);
        while pending(st) {
            if st.wait_until(&self.sealed, deadline).timed_out() {
                break;
            }
        }
    }

    /// For each key of `ns`: the policy's answer to `access` on its entry, then `act` on it.
    /// A missing key is not found (for a caller who may look it up). One outcome per key.
    fn each_entry(
        st: &mut State,
        c: &Caller,
        ns: &str,
        keys: &[String],
        access: for<'a> fn(&'a Perm) -> Access<'a>,
        mut act: impl FnMut(&mut State, u64) -> Result<()>,
    ) -> Result<Vec<Result<()>>> {
        st.ns.get(ns)?;
        let chain = st.ns.chain(ns);
        Ok(keys
            .iter()
            .map(|k| match st.ns.get(ns)?.entries.get(k).copied() {
                Some(ino) => {
                    let perm = st.entries[&ino].perm();
                    policy::check(c, &chain, ns, access(&perm))?;
                    act(st, ino)
                }
                None => {
                    policy::check(c, &chain, ns, Access::Lookup)?;
                    Err(Error::NotFound(format!("{ns}/{k}")))
                }
            })
            .collect())
    }

    /// Lists a namespace: itself (not the root), its children and its entries whose names come
    /// after `after` (all when None), the first `max` of them in name order (each list sorted
    /// by name); and whether names remain after those. A page costs one pass over the
    /// namespace's names under the lock, and the sort of its own (not of the namespace).
    pub fn list(&self, c: &Caller, ns: &str, after: Option<&str>, max: usize) -> Result<NsListing> {
        if !ns.is_empty() {
            split_ns(ns)?;
        }
        let mut st = self.lock();
        Self::allow(&st, c, ns, Access::List)?;
        // Names whose writers closed them are listed, as a lookup finds them.
        self.wait_while(&mut st, |st| {
            st.ns
                .get(ns)
                .is_ok_and(|n| n.writing.keys().any(|k| publication_imminent(st, ns, k)))
        });
        let n = st.ns.get(ns)?;
        // Fenced off, the shared pool's entries are not this host's to show (as a lookup
        // misses them).
        let fenced = self.authority.fenced();
        let later = |name: &str| after.is_none_or(|a| name > a);
        // The names after `after` (None: a child; no name is both), the first `max` of them.
        let mut names: Vec<(&str, Option<u64>)> = n
            .children
            .keys()
            .filter(|name| later(name))
            .map(|name| (name.as_str(), None))
            .chain(
                n.entries
                    .iter()
                    .filter(|(name, ino)| later(name) && !st.fenced_off(fenced, **ino))
                    .map(|(name, &ino)| (name.as_str(), Some(ino))),
            )
            .collect();
        let more = names.len() > max;
        if more {
            names.select_nth_unstable(max);
            names.truncate(max);
        }
        names.sort_unstable();
        let mut children = Vec::new();
        let mut entries = Vec::new();
        for (name, ino) in names {
            match ino {
                Some(ino) => entries.push(st.entries[&ino].located(false)),
                None => children.extend(st.ns.info(&join(ns, name))),
            }
        }
        let me = (!ns.is_empty()).then(|| st.ns.info(ns)).flatten();
        Ok((me, children, entries, more))
    }

    /// The pools' descriptions; `huge`: [`shmem_huge_bytes`], read before the lock is taken.
    fn pool_infos(st: &State, huge: u64) -> Vec<PoolInfo> {
        st.pools
            .iter()
            .map(|p| {
                let used = p.pool.used();
                PoolInfo {
                    id: p.id.get(),
                    name: p.name.clone(),
                    kind: p.kind,
                    path: p.path.display().to_string(),
                    capacity: p.pool.capacity(),
                    mapped_len: p.pool.mapped_len(),
                    used,
                    sealed_bytes: p.sealed_bytes,
                    entries: p.entries,
                    writing_bytes: p.writing_bytes,
                    huge_bytes: if p.kind == PoolKind::Memfs {
                        huge.min(used)
                    } else {
                        0
                    },
                    evictions: p.evictions,
                    coherence: p.pool.coherence(),
                }
            })
            .collect()
    }

    /// Pool descriptions.
    pub fn pools(&self) -> Vec<PoolInfo> {
        let huge = shmem_huge_bytes();
        Self::pool_infos(&self.lock(), huge)
    }

    /// Store-wide statistics.
    pub fn stats(&self) -> Stats {
        let huge = shmem_huge_bytes();
        let st = self.lock();
        let mut namespaces: Vec<NsInfo> = st.ns.iter().filter_map(|(k, _)| st.ns.info(k)).collect();
        namespaces.sort_by(|a, b| a.ns.cmp(&b.ns));
        let mut clients: Vec<ClientInfo> = st
            .sessions
            .iter()
            .map(|(id, s)| {
                let allocated = s
                    .allocs
                    .iter()
                    .filter_map(|a| st.allocs.get(a))
                    .map(|a| a.acct)
                    .sum();
                let c = s.caller.clone().unwrap_or_else(Caller::root);
                ClientInfo {
                    session: id.get(),
                    name: s.name.clone(),
                    pid: c.pid,
                    uid: c.uid,
                    allocated,
                    used: s.used,
                    slack: st.pools.iter().map(|p| p.pool.slack(*id)).sum(),
                    leases: s.leases.values().map(|n| u64::from(*n)).sum(),
                }
            })
            .collect();
        clients.sort_by_key(|c| c.session);
        let pools = Self::pool_infos(&st, huge);
        let cluster = self.authority.cluster().map(|mut c| {
            let elsewhere = st.entries.values().filter(|e| e.remote().is_some()).count() as u64;
            c.entries_elsewhere = elsewhere;
            c.entries_here = st.entries.len() as u64 - elsewhere;
            for h in c.hosts.iter_mut().filter(|h| h.node == c.node) {
                h.entries = c.entries_here;
            }
            Box::new(c)
        });
        drop(st);
        let (latency_us, latency_sum_us) = self.counters.latency();
        Stats {
            pools,
            namespaces,
            clients,
            ops: self.counters.ops(),
            eviction: match self.cfg.eviction {
                Eviction::Lru => "lru".into(),
                Eviction::Off => "off".into(),
            },
            bytes: self.counters.bytes(),
            latency_us,
            latency_sum_us,
            uptime_s: self.started.elapsed().as_secs_f64(),
            cluster,
            remote: self.remote.get().map(|r| Box::new(r.info())),
        }
    }

    /// Evicts LRU entries until `bytes` are free in every pool (or nothing is left to
    /// evict); root only. Returns (entries, bytes) evicted.
    pub fn evict(&self, c: &Caller, bytes: u64) -> Result<(u64, u64)> {
        let mut st = self.lock();
        Self::allow(&st, c, "", Access::Evict)?;
        let mut total = (0, 0);
        for p in (0..st.pools.len()).map(PoolIdx::at) {
            let free = st.pools[p].pool.free_space();
            if free < bytes {
                let (n, b) = self.evict_lru(&mut st, Some(p), bytes - free);
                total.0 += n;
                total.1 += b;
            }
        }
        Ok(total)
    }

    /// Checks every invariant the tests rely on; returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = self.lock();
        for p in &st.pools {
            let sealed: u64 = st
                .entries
                .values()
                .filter(|e| e.pool() == p.id)
                .map(|e| e.asize())
                .sum();
            if sealed != p.sealed_bytes {
                return Err(format!(
                    "pool {}: sealed bytes {} != {}",
                    p.name, p.sealed_bytes, sealed
                ));
            }
            p.pool.check()?;
        }
        for (k, n) in st.ns.iter() {
            for (key, ino) in &n.entries {
                let e = st
                    .entries
                    .get(ino)
                    .ok_or_else(|| format!("{k}/{key}: dangling"))?;
                match n.index.lookup(key) {
                    Some(v) if v.generation == e.ino() && v.flags == e.flags() => {}
                    other => return Err(format!("{k}/{key}: index says {other:?}")),
                }
                match self.authority.holder(k, key) {
                    Some(authority::Claim::Published(g)) if g == e.ino() => {}
                    other => return Err(format!("{k}/{key}: the authority says {other:?}")),
                }
            }
        }
        // An entry's holds are its sessions' holds on it, and sessions hold live entries only.
        let mut holds: std::collections::HashMap<u64, u32> = Default::default();
        for s in st.sessions.values() {
            for (ino, n) in &s.holds {
                *holds.entry(*ino).or_insert(0) += n;
            }
        }
        for (ino, n) in &holds {
            match st.entries.get(ino) {
                Some(e) if e.holds() == *n => {}
                other => {
                    return Err(format!(
                        "inode {ino}: sessions hold it {n} times, the entry says {:?}",
                        other.map(|e| e.holds())
                    ));
                }
            }
        }
        if let Some(e) = st
            .entries
            .values()
            .find(|e| e.holds() > 0 && !holds.contains_key(&e.ino()))
        {
            return Err(format!(
                "{}/{}: held {} times by no session",
                e.ns(),
                e.key(),
                e.holds()
            ));
        }
        // Every entry is filed once in the LRU order, under a key no later than its last use.
        if st.lru.len() != st.entries.len() {
            return Err(format!(
                "lru files {} entries, the store has {}",
                st.lru.len(),
                st.entries.len()
            ));
        }
        for (ino, e) in &st.entries {
            if st.lru.filed_under(e.lru().filed) != Some(*ino) || e.lru().used < e.lru().filed {
                return Err(format!(
                    "inode {ino}: filed under {} in lru ({:?}), last used at {}",
                    e.lru().filed,
                    st.lru.filed_under(e.lru().filed),
                    e.lru().used
                ));
            }
        }
        Ok(())
    }

    /// Unmounts the memfs pools this daemon mounted (clean shutdown with `--unmount-pools`).
    pub fn unmount_pools(&self) {
        for p in &self.lock().pools {
            p.pool.unmount();
        }
    }

    /// Takes the store's lock (see the rule above; [`locked`]).
    fn lock(&self) -> Locked<'_> {
        Locked::new(&self.st)
    }

    /// Makes raw pool logs durable.
    pub fn sync(&self) {
        for p in &mut self.lock().pools {
            p.pool.sync();
        }
    }
}

/// True if `ns/key` is being written through the mount and its writer's close committed it.
fn publication_imminent(st: &State, ns: &str, key: &str) -> bool {
    writer_of(st, ns, key).is_some_and(|m| m.committed())
}

/// Whether `ns/key` is being written through the mount and its publication is at the
/// authority (the store's lock let go of meanwhile).
fn publication_asked(st: &State, ns: &str, key: &str) -> bool {
    writer_of(st, ns, key).is_some_and(|m| m.asking())
}

/// The writer of `ns/key` through the mount, if one is writing it.
fn writer_of<'a>(st: &'a State, ns: &str, key: &str) -> Option<&'a writer::MountWrite> {
    st.ns
        .get(ns)
        .ok()
        .and_then(|n| n.writing.get(key))
        .and_then(|id| st.allocs.get(id))
        .and_then(Alloc::mount)
}

/// Bytes of shared memory held in 2 MiB pages (`ShmemHugePages`): all memfs pools and any
/// other tmpfs together; reported per pool capped by its use.
fn shmem_huge_bytes() -> u64 {
    maru::host::meminfo("ShmemHugePages").unwrap_or(0) * 1024
}
