//! The metadata the store's lock guards, and its types.

use super::writer::MountWrite;
use std::collections::HashSet;
use std::time::SystemTime;

use maru::index::{FLAG_HELD, FLAG_PINNED, SlotView};
use maru::proto::{Located, PoolKind};
use maru_fsd::{Attr, Caller, Kind};

use super::hashmap::HashMap;
use super::ids::{PoolIdx, SessionId};
use super::lru::{Lru, Stamp};
use super::namespaces::Namespaces;
use super::policy::Perm;
use super::pools::{Backing, Loc, Pool};

/// A sealed entry.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Inode, also its generation: unique for the daemon's life.
    pub ino: u64,
    /// Namespace.
    pub ns: String,
    /// Key.
    pub key: String,
    /// Pool.
    pub pool: PoolIdx,
    /// Offset in the pool (raw pools).
    pub offset: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes reserved in the pool.
    pub asize: u64,
    /// Protected from eviction by the operator (persistent).
    pub pinned: bool,
    /// Holds of client sessions (`Op::Hold`, every session's together): protected from
    /// eviction while > 0. Not persistent: sessions do not outlive the daemon.
    pub holds: u32,
    /// Place in the LRU order.
    pub lru: Stamp,
    /// The client session that stored it, while connected.
    pub owner: Option<SessionId>,
    /// Leases on its extent (raw pools): retrievals whose mappings are alive.
    pub leases: u32,
    /// Owner, group and mode.
    pub perm: Perm,
    /// Publication time.
    pub mtime: SystemTime,
    /// Published by another host sharing the pool (cluster mode): the revision at which the
    /// authority created it (its identity there). Its extent is not this host's to free, and
    /// this host never evicts it.
    pub remote: Option<i64>,
    /// Clients of other hosts pin this host's entry (cluster mode): not evicted while they do.
    pub pinned_elsewhere: bool,
    /// Another host's entry not read here yet: on a pool without coherence across hosts, its
    /// stale cache lines are dropped before the first read ([`State::ready_remote`]).
    pub cold: bool,
    /// A delete's round trip to the authority is on its way (cluster mode): not evicted,
    /// renamed or deleted again meanwhile.
    pub withdrawing: bool,
}

impl AsMut<Stamp> for Entry {
    fn as_mut(&mut self) -> &mut Stamp {
        &mut self.lru
    }
}

impl Entry {
    /// A sealed entry of `size` bytes at `offset` of `pool`, published now: not pinned, held
    /// or leased, nobody's session's, this host's; its room in the pool is `size` rounded up
    /// to the pool's alignment.
    pub fn new(
        ino: u64,
        ns: &str,
        key: &str,
        pool: PoolIdx,
        offset: u64,
        size: u64,
        perm: Perm,
    ) -> Self {
        Entry {
            ino,
            ns: ns.to_owned(),
            key: key.to_owned(),
            pool,
            offset,
            size,
            asize: crate::alloc::align_up(size.max(1), crate::pool::ENTRY_ALIGN),
            pinned: false,
            holds: 0,
            lru: Default::default(),
            owner: None,
            leases: 0,
            perm,
            mtime: SystemTime::now(),
            remote: None,
            pinned_elsewhere: false,
            cold: false,
            withdrawing: false,
        }
    }

    /// What its pool needs to know of it.
    pub fn loc(&self) -> Loc<'_> {
        Loc {
            ns: &self.ns,
            key: &self.key,
            offset: self.offset,
            size: self.size,
            asize: self.asize,
            pinned: self.pinned,
            uid: self.perm.uid,
            gid: self.perm.gid,
            mode: self.perm.mode,
        }
    }

    /// Its attributes, as the mount shows them.
    pub fn attr(&self) -> Attr {
        Attr {
            ino: self.ino,
            kind: Kind::File,
            size: self.size,
            mode: self.perm.mode,
            uid: self.perm.uid,
            gid: self.perm.gid,
            mtime: self.mtime,
            sealed: true,
        }
    }

    /// Its slot in the shared index.
    pub fn slot_view(&self) -> SlotView {
        SlotView {
            generation: self.ino,
            size: self.size,
            pool: self.pool.get(),
            flags: self.flags(),
            offset: self.offset,
        }
    }

    /// Its flags in the shared index: pinned, held.
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.pinned {
            f |= FLAG_PINNED;
        }
        if self.holds > 0 || self.pinned_elsewhere {
            f |= FLAG_HELD;
        }
        f
    }

    /// Whether eviction must pass it by: pinned, held (here or on other hosts), leased, or
    /// another host's.
    pub fn protected(&self) -> bool {
        self.pinned
            || self.holds > 0
            || self.pinned_elsewhere
            || self.leases > 0
            || self.remote.is_some()
            || self.withdrawing
    }

    /// Where it is, for a client.
    pub fn located(&self, fd: bool) -> Located {
        Located {
            key: self.key.clone(),
            generation: self.ino,
            pool: self.pool.get(),
            offset: self.offset,
            size: self.size,
            pinned: self.pinned,
            holds: self.holds,
            fd,
        }
    }
}

/// Who writes an allocation and how it gets published.
#[derive(Debug)]
pub enum Origin {
    /// Granted to a client session (libmaru), published by its `publish`.
    Session(SessionId),
    /// Created through the mount, published at its writer's last release.
    Mount(MountWrite),
}

/// An allocation: an entry being written.
#[derive(Debug)]
pub struct Alloc {
    /// Pool.
    pub pool: PoolIdx,
    /// Bytes granted (socket) or 0 (mount: see [`MountWrite::len`]).
    pub size: u64,
    /// Who writes it.
    pub origin: Origin,
    /// Where its bytes are.
    pub backing: Backing,
    /// Owner, group and mode it will have.
    pub perm: Perm,
    /// Last change.
    pub mtime: SystemTime,
    /// Bytes counted in the pool's `writing_bytes`.
    pub acct: u64,
}

impl Alloc {
    /// The mount's view of it, when written through the mount.
    pub fn mount(&self) -> Option<&MountWrite> {
        match &self.origin {
            Origin::Mount(m) => Some(m),
            Origin::Session(_) => None,
        }
    }

    /// The mount's view of it, to change.
    pub fn mount_mut(&mut self) -> Option<&mut MountWrite> {
        match &mut self.origin {
            Origin::Mount(m) => Some(m),
            Origin::Session(_) => None,
        }
    }

    /// The client session it was granted to.
    pub fn session(&self) -> Option<SessionId> {
        match self.origin {
            Origin::Session(s) => Some(s),
            Origin::Mount(_) => None,
        }
    }

    /// Its current size.
    pub fn size_now(&self) -> u64 {
        match &self.origin {
            Origin::Mount(m) => m.len,
            Origin::Session(_) => self.size,
        }
    }

    /// Its attributes, as its writer sees them through the mount.
    pub fn attr(&self, ino: u64) -> Attr {
        Attr {
            ino,
            kind: Kind::File,
            size: self.size_now(),
            mode: self.perm.mode,
            uid: self.perm.uid,
            gid: self.perm.gid,
            mtime: self.mtime,
            sealed: false,
        }
    }
}

/// A name removed behind the kernel's back.
#[derive(Debug, Clone)]
pub struct Invalidation {
    /// Parent directory inode.
    pub parent: u64,
    /// Name in it.
    pub name: String,
    /// The removed node.
    pub ino: u64,
    /// The kernel removed the name itself (unlink through the mount): only the node's
    /// passthrough backing is to be dropped, the name needs no invalidation.
    pub by_kernel: bool,
}

/// A client connection.
#[derive(Default)]
pub struct Session {
    /// The client's name.
    pub name: String,
    /// Who it is.
    pub caller: Option<Caller>,
    /// Its unpublished allocations.
    pub allocs: HashSet<u64>,
    /// Leases it holds: inode → count.
    pub leases: HashMap<u64, u32>,
    /// Holds it has on entries (`Op::Hold`): inode → count.
    pub holds: HashMap<u64, u32>,
    /// Bytes of entries it stored.
    pub used: u64,
}

/// A pool with its accounting.
pub struct PoolSlot {
    /// Index in the store's list.
    pub id: PoolIdx,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: PoolKind,
    /// Path.
    pub path: std::path::PathBuf,
    /// The pool.
    pub pool: Box<dyn Pool>,
    /// Bytes reserved by sealed entries.
    pub sealed_bytes: u64,
    /// Sealed entries.
    pub entries: u64,
    /// Bytes of allocations being written.
    pub writing_bytes: u64,
    /// Entries evicted.
    pub evictions: u64,
}

/// Everything the store's lock guards.
pub struct State {
    /// The next inode (entries, allocations and namespaces share the space).
    pub(super) next_ino: u64,
    /// Namespaces.
    pub(super) ns: Namespaces,
    /// Sealed entries by inode.
    pub(super) entries: HashMap<u64, Entry>,
    /// Deleted raw-pool entries whose extent is still leased.
    pub(super) zombies: HashMap<u64, Entry>,
    /// Allocations by id (an inode too).
    pub(super) allocs: HashMap<u64, Alloc>,
    /// LRU order of `entries`.
    pub(super) lru: Lru,
    /// Client sessions.
    pub(super) sessions: HashMap<SessionId, Session>,
    /// The next session id.
    pub(super) next_session: SessionId,
    /// The pools.
    pub(super) pools: Vec<PoolSlot>,
    /// Attributes of recently removed entries (for handles still open on them).
    pub(super) gone: HashMap<u64, Attr>,
    /// Leases held by handles of the mount (raw pools).
    pub(super) fuse_leases: HashMap<u64, u32>,
}

impl State {
    /// A fresh inode number.
    pub fn alloc_ino(&mut self) -> u64 {
        let i = self.next_ino;
        self.next_ino += 1;
        i
    }

    /// The caller of client session `session`.
    pub fn caller(&self, session: SessionId) -> maru::Result<Caller> {
        self.sessions
            .get(&session)
            .and_then(|s| s.caller.clone())
            .ok_or_else(|| maru::Error::Protocol("no such session".into()))
    }

    /// Gives the directories of namespace `ns`, in every pool where entries are files, the
    /// namespace's access (so that the kernel decides opens through them as the policy does).
    /// A pool that fails closes its directory to all but root: its entries are then asked of
    /// marud.
    pub fn mirror_ns_access(&mut self, ns: &str) {
        let Ok(n) = self.ns.get(ns) else { return };
        let perm = n.perm;
        for p in &mut self.pools {
            if let Err(e) = p.pool.set_ns_access(ns, &perm) {
                tracing::error!(ns, pool = %p.name, "giving a namespace directory its access: {e}");
            }
        }
    }

    /// Marks a use of entry `ino`; false when there is no such entry.
    pub fn touch(&mut self, ino: u64) -> bool {
        match self.entries.get_mut(&ino) {
            Some(e) => {
                self.lru.touch(&mut e.lru);
                true
            }
            None => false,
        }
    }
}

impl std::ops::Index<PoolIdx> for Vec<PoolSlot> {
    type Output = PoolSlot;
    fn index(&self, p: PoolIdx) -> &PoolSlot {
        &self[p.slot()]
    }
}

impl std::ops::IndexMut<PoolIdx> for Vec<PoolSlot> {
    fn index_mut(&mut self, p: PoolIdx) -> &mut PoolSlot {
        &mut self[p.slot()]
    }
}
