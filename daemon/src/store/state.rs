//! The metadata the store's lock guards, and its types.

use super::writer::MountWrite;
use std::collections::HashSet;
use std::time::SystemTime;

use maru::proto::PoolKind;
use maru_fsd::{Attr, Caller, Kind};

use super::entries::Entry;
use super::hashmap::HashMap;
use super::ids::{PoolIdx, SessionId};
use super::lru::Lru;
use super::namespaces::Namespaces;
use super::policy::Perm;
use super::pools::{Backing, Pool};

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
    /// Deleted raw-pool entries whose extent is still leased here or mapped by other hosts,
    /// and publications the shared authority granted and the store gave back
    /// (`Store::give_back`), whose extent other hosts may map.
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
    /// Other hosts' entries whose first hold here is being recorded at the authority for
    /// their publisher (`Store::hold`): other holds of them wait for the outcome.
    pub(super) pinning: HashSet<u64>,
}

impl State {
    /// A store's state with no pool, no namespace and no session (the lock's own tests).
    #[cfg(test)]
    pub(super) fn empty(dir: &std::path::Path) -> State {
        State {
            next_ino: maru_fsd::backend::ROOT_INO + 1,
            ns: super::namespaces::Namespaces::new(dir.join("namespaces.json"))
                .expect("namespaces"),
            entries: Default::default(),
            zombies: Default::default(),
            allocs: Default::default(),
            lru: Default::default(),
            sessions: Default::default(),
            next_session: super::ids::SessionId::MOUNT.next(),
            pools: Vec::new(),
            gone: Default::default(),
            fuse_leases: Default::default(),
            pinning: Default::default(),
        }
    }

    /// What the critical section appended to the pools' logs and did not sync yet
    /// (`--wal-sync`; [`super::locked::Locked`] waits for it once the lock is let go).
    pub(super) fn take_unsynced(&mut self) -> Vec<crate::wal::Unsynced> {
        self.pools
            .iter_mut()
            .filter_map(|p| p.pool.take_unsynced())
            .collect()
    }

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
                self.lru.touch(e.as_mut());
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
