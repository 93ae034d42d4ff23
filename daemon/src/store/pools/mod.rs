//! Pools behind one trait: where entry bytes live and how their metadata persists.
//! [`memfs::Memfs`] keeps each entry in its own file of a memory filesystem (the tree is the
//! metadata), small ones packed into shared files ([`packs`]); [`raw::Raw`] carves a device
//! (or a file standing in for one) into regions and keeps its metadata in a log.

pub mod buffer;
pub mod memfs;
pub mod packs;
pub mod raw;

use std::fs::File;
use std::sync::Arc;

use super::ids::{Place, SessionId};
use super::policy::Perm;
use maru::Result;
use maru::proto::PoolKind;

/// Where an allocation's bytes are while it is written.
#[derive(Debug)]
pub enum Backing {
    /// Its own file (memfs).
    File {
        /// The file, open read-write.
        file: Arc<File>,
        /// Bytes the file spans (it grows ahead of the writer, to 2 MiB boundaries, so that a
        /// tmpfs with `huge=within_size` gives it 2 MiB pages).
        span: u64,
        /// The mode the daemon created it with (owned by root): publication changes only what
        /// differs, sparing a system call or two per store.
        mode: u32,
    },
    /// An extent of a raw pool (socket grants: the client writes into the mapped device).
    Extent {
        /// Offset in the pool.
        offset: u64,
    },
    /// Bytes carved from a memfs pool's pack (a small allocation of a client that said in
    /// which namespace it will publish it).
    Packed {
        /// The pack.
        pack: u32,
        /// Offset in the pack.
        offset: u64,
        /// Bytes reserved there.
        len: u64,
        /// The pack, open read-write.
        file: Arc<File>,
    },
    /// Bytes buffered by the daemon (a raw pool written through the mount); copied into the
    /// extent reserved at the writer's close, without the store's lock ([`buffer::CopyIn`]).
    Buffer {
        /// The bytes, behind a lock of their own.
        buf: buffer::Shared,
        /// The extent reserved for them (offset, bytes it holds).
        placed: Option<(u64, u64)>,
    },
}

impl Backing {
    /// Its offset in a raw pool, once it has one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Backing::Extent { offset }
            | Backing::Buffer {
                placed: Some((offset, _)),
                ..
            } => Some(*offset),
            _ => None,
        }
    }

    /// The file a writer's mappings pass through to (memfs).
    pub fn file(&self) -> Option<Arc<File>> {
        match self {
            Backing::File { file, .. } => Some(file.clone()),
            _ => None,
        }
    }
}

/// A sealed entry's bytes for a reader: a descriptor and the offset of the entry's first
/// byte in it.
pub struct Reader {
    pub file: Arc<File>,
    pub base: u64,
}

impl Reader {
    /// Reads `buf.len()` bytes at `offset` within the entry.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        Ok(self.file.read_exact_at(buf, self.base + offset)?)
    }
}

/// Who asks for an allocation, and what it will be.
#[derive(Debug, Clone, Copy)]
pub struct Requester<'a> {
    /// The client session (None: the mount's writers).
    pub session: Option<SessionId>,
    /// The namespace the client said it will publish it in.
    pub ns: Option<&'a str>,
    /// The entry's owner, group and mode.
    pub perm: &'a Perm,
}

/// What a pool needs to know of an entry it holds.
#[derive(Debug, Clone, Copy)]
pub struct Loc<'a> {
    /// Namespace.
    pub ns: &'a str,
    /// Key.
    pub key: &'a str,
    /// Where its bytes are.
    pub place: Place,
    /// Bytes.
    pub size: u64,
    /// Bytes reserved.
    pub asize: u64,
    /// Pinned.
    pub pinned: bool,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Mode.
    pub mode: u32,
}

/// A sealed entry found by a pool at start.
#[derive(Debug)]
pub struct Found {
    /// Namespace.
    pub ns: String,
    /// Key.
    pub key: String,
    /// Where its bytes are.
    pub place: Place,
    /// Bytes.
    pub size: u64,
    /// Pinned.
    pub pinned: bool,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Mode.
    pub mode: u32,
    /// Modification time.
    pub mtime: std::time::SystemTime,
}

impl Found {
    /// An entry at `place` whose owner, group, mode and modification time are those of file
    /// `md` (a memfs entry's own file, or its pack).
    pub fn of(
        ns: String,
        key: String,
        place: Place,
        size: u64,
        pinned: bool,
        md: &std::fs::Metadata,
    ) -> Found {
        use std::os::unix::fs::MetadataExt;
        Found {
            ns,
            key,
            place,
            size,
            pinned,
            uid: md.uid(),
            gid: md.gid(),
            mode: md.mode() & 0o7777,
            mtime: md
                .modified()
                .unwrap_or_else(|_| std::time::SystemTime::now()),
        }
    }
}

/// What a pool does for a grant without the store's lock: the slow part of it (a memfs
/// file's `fallocate`, as long as zeroing the pages), made by any thread, touching nothing
/// the lock guards.
pub trait Prepare: Send + Sync {
    /// Whether a grant of `size` bytes for `who` has a slow part made here; false when it is
    /// the pool's to make under the lock ([`Pool::grant`]: a piece of a pack).
    fn prepares(&self, size: u64, who: &Requester<'_>) -> bool;
    /// The backing of such a grant, made now (without the lock).
    fn prepare(&self, size: u64) -> Result<Backing>;
}

/// What holds a pack's memory, as eviction weighs it: the memory comes back only with the
/// pack's file, once nothing lives in it and it takes no more allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Sealed entries and allocations in it (removed entries still leased too).
    pub live: u32,
    /// Still takes allocations (the open pack of a session).
    pub open: bool,
    /// Bytes handed out of it: at most what its file holds in the pool.
    pub bytes: u64,
}

/// One pool.
pub trait Pool: Send {
    /// Kind.
    fn kind(&self) -> PoolKind;
    /// Bytes usable for entries (as reported to users).
    fn capacity(&self) -> u64;
    /// Bytes free for new entries.
    fn free_space(&self) -> u64;
    /// Bytes of the device or file entries are offsets into (0 where entries are files).
    fn mapped_len(&self) -> u64 {
        0
    }
    /// Bytes in use.
    fn used(&self) -> u64 {
        self.capacity().saturating_sub(self.free_space())
    }
    /// The UUID of a raw pool's device header (its identity across hosts); None for memfs.
    fn uuid(&self) -> Option<&str> {
        None
    }
    /// Files the 2 MiB units of `[offset, offset + len)` as holding an entry another host
    /// published (raw pools: never carved here while any such entry lives in them).
    fn adopt_remote(&mut self, _offset: u64, _len: u64) -> Result<()> {
        Err(maru::Error::Unsupported(
            "only raw pools hold other hosts' entries".into(),
        ))
    }
    /// An entry another host published, at `[offset, offset + len)`, is gone.
    fn drop_remote(&mut self, _offset: u64, _len: u64) {}
    /// Cache maintenance so far (pools without hardware coherence across hosts).
    fn coherence(&self) -> Option<maru::proto::Coherence> {
        None
    }
    /// Without hardware coherence across hosts: the device, for a writer's lines to be
    /// written back before its entry is published (by the caller, without the store's lock,
    /// before any other host can learn of the entry), and a reader's stale lines of another
    /// host's entry dropped before its first read here (likewise: `Store::drop_stale`).
    fn write_back(&self) -> Option<Arc<crate::coherence::WriteBack>> {
        None
    }
    /// Whether the mount serves entries by passthrough to their own file (where entries
    /// written through it go).
    fn passthrough(&self) -> bool;
    /// Whether the mount serves entry `e` by passthrough (else by copy).
    fn passes_through(&self, _e: &Loc<'_>) -> bool {
        self.passthrough()
    }
    /// Whether a retrieval must hold a lease on the entry's extent (raw pools: the extent is
    /// reused once free, even under a client's mapping).
    fn leases(&self) -> bool;

    /// What this pool's grants do without the store's lock, if anything ([`Prepare`]).
    fn preparer(&self) -> Option<Arc<dyn Prepare>> {
        None
    }
    /// Reserves `size` bytes for allocation `id` of `who` (raw pools pack a session's
    /// allocations into its open region; memfs pools a session's small ones for one namespace
    /// into a pack).
    fn grant(&mut self, id: u64, size: u64, who: &Requester<'_>) -> Result<Backing>;
    /// The region (offset, bytes) carved for allocation `id` by [`Pool::grant`] or
    /// [`Pool::commit`] whose claim at the authority is still to be made: the store makes it
    /// (without its lock where the authority is shared: a round trip) before the allocation
    /// is used, and reports how it went ([`Pool::claimed`]). None: nothing to claim.
    fn unclaimed(&self, _id: u64) -> Option<(u64, u64)> {
        None
    }
    /// The claim of the region at `offset` ([`Pool::unclaimed`]) was made, or refused: the
    /// region then goes with the allocation it was carved for, which the store drops without
    /// [`Pool::abort`] (what another host claimed first, [`maru::Error::Busy`], is set aside).
    fn claimed(&mut self, _offset: u64, _outcome: &Result<()>) {}
    /// An empty allocation for a writer through the mount.
    fn create(&mut self, id: u64) -> Result<Backing>;
    /// Frees an allocation that will not be published.
    fn abort(&mut self, id: u64, backing: &Backing);
    /// Readies allocation `id` for a publication of `size` bytes, at its writer's close and
    /// again before its publication: a memfs file takes its size; a buffered allocation (raw
    /// pools through the mount) gets room for `size` bytes, and the copy of its bytes there
    /// when they are not there yet, for the caller to run without the store's lock.
    fn commit(
        &mut self,
        id: u64,
        backing: &mut Backing,
        size: u64,
    ) -> Result<Option<buffer::CopyIn>>;
    /// Publishes allocation `id` as `e` (`e.place` is ignored); returns where the entry is: an
    /// extent (raw pools), a file of its own or a piece of a pack (memfs).
    fn publish(&mut self, id: u64, backing: &mut Backing, e: &Loc<'_>) -> Result<Place>;
    /// Removes a sealed entry; false when its extent stays reserved (leased): free it with
    /// [`Pool::free_extent`] when the last lease goes.
    fn delete(&mut self, e: &Loc<'_>, leased: bool) -> bool;
    /// Frees the bytes of a deleted entry (at `place`) whose last lease went.
    fn free_extent(&mut self, place: Place);
    /// What holds the memory of pack `pack` (memfs): eviction weighs a packed entry by it,
    /// since its bytes come back only with its pack's. None where the pool has no such pack.
    fn pack(&self, _pack: u32) -> Option<Usage> {
        None
    }
    /// Moves a sealed entry to `ns/key`; returns its new location if that changed (a packed
    /// entry moved to another namespace leaves its pack).
    fn rename(&mut self, e: &Loc<'_>, ns: &str, key: &str) -> Result<Option<Place>>;
    /// Records a pin change.
    fn set_pinned(&mut self, e: &Loc<'_>, pinned: bool) -> Result<()>;
    /// Records a change of owner or mode; returns the entry's new location if that changed
    /// (a packed entry leaves its pack).
    fn set_owner_mode(&mut self, e: &Loc<'_>) -> Result<Option<Place>>;
    /// A descriptor for a client's retrieval: memfs the entry's file (a packed entry's pack,
    /// when `first`: a reply carries each pack once); raw the pool's read-only descriptor,
    /// when `first` (a connection gets it once).
    fn retrieve_fd(&self, e: &Loc<'_>, first: bool) -> Result<Option<File>>;
    /// The entry's own file, opened read-only (passthrough pools).
    fn open_entry(&self, e: &Loc<'_>) -> Result<File>;
    /// Where a sealed entry's bytes are, for a read made without the store's lock (a raw
    /// pool's caller holds a lease on the extent meanwhile; a pack never reuses its bytes).
    fn reader(&self, e: &Loc<'_>) -> Result<Reader>;
    /// A descriptor of the whole device for clients (raw pools).
    fn device_fd(&self, write: bool) -> Result<File>;
    /// Where the entry lives, for `user.maru.location`.
    fn location(&self, e: &Loc<'_>) -> String;
    /// Prepares the namespace `ns` (memfs: its directory).
    fn ensure_ns(&mut self, ns: &str) -> Result<()>;
    /// A descriptor of the directory in which `ns`'s entries are files named by their keys
    /// (memfs); None where entries are not files.
    fn ns_dir(&self, _ns: &str) -> Result<Option<File>> {
        Ok(None)
    }
    /// The directory of the pool's packs (memfs), for root clients to open packs in.
    fn pack_dir(&self) -> Result<Option<File>> {
        Ok(None)
    }
    /// Gives the namespace's directory (memfs) the namespace's access `perm` for search and
    /// read (see [`crate::pool::memfs::MemfsPool::set_ns_access`]); nothing where entries are not
    /// files.
    fn set_ns_access(&mut self, _ns: &str, _perm: &Perm) -> Result<()> {
        Ok(())
    }
    /// Whether the kernel applies each namespace's access to its directory here (memfs pools
    /// on a tmpfs with ACLs), so that a client that is not root may open entries through it.
    fn mirrors_access(&self) -> bool {
        false
    }
    /// Removes the namespace `ns` (memfs: its empty directory).
    fn remove_ns(&mut self, ns: &str);
    /// The sealed entries and namespaces found at start; unsealed work is discarded.
    fn recover(&mut self) -> Result<(Vec<String>, Vec<Found>)>;
    /// After recovery: `kept` are the offsets (raw) of the found entries the store kept.
    fn recovered(&mut self, kept: &[Loc<'_>]) -> Result<()>;
    /// A client session ended: its open region (raw) or packs (memfs) take no more.
    fn detach(&mut self, session: SessionId);
    /// Bytes of a session's open region not yet used (raw).
    fn slack(&self, session: SessionId) -> u64;
    /// Makes logged metadata durable.
    fn sync(&mut self);
    /// What the store's critical section appended to the pool's log and did not sync yet
    /// (`--wal-sync`: synced after the lock, [`crate::wal::Unsynced`]); frees first the
    /// extents whose removal waited for an earlier sync.
    fn take_unsynced(&mut self) -> Option<crate::wal::Unsynced> {
        None
    }
    /// Unmounts what this daemon mounted for the pool (clean shutdown).
    fn unmount(&self);
    /// Checks the pool's own accounting.
    fn check(&self) -> std::result::Result<(), String>;
    /// Test seams: a memfs pool's metadata gate, a raw pool's log sink.
    #[cfg(feature = "seams")]
    fn seams(&mut self) -> Seams<'_>;
}

/// The crash-injection seams of a pool (tests, feature `seams`).
#[cfg(feature = "seams")]
pub enum Seams<'a> {
    /// A memfs pool.
    Memfs(&'a crate::pool::memfs::MemfsPool),
    /// A raw pool's log.
    Raw(&'a mut Option<crate::wal::Wal>),
}

/// The kind's name, as `user.maru.kind` shows it.
pub fn kind_name(k: PoolKind) -> &'static str {
    match k {
        PoolKind::Memfs => "memfs",
        PoolKind::Devdax => "devdax",
        PoolKind::File => "file",
    }
}
