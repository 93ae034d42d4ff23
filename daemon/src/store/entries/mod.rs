//! Sealed entries: the entry, whose fields no module but this one and its child [`table`]
//! writes (the compiler keeps it so), and why one goes.

use std::time::SystemTime;

use maru::Result;
use maru::index::{FLAG_HELD, FLAG_PINNED, SlotView};
use maru::proto::Located;
use maru_fsd::{Attr, Kind};

use super::authority::Withdrawn;
use super::ids::{Place, PoolIdx, SessionId, SharedId};
use super::lru::Stamp;
use super::policy::Perm;
use super::pools::Loc;

mod table;

/// A sealed entry. Its fields are this module's: other modules read them through its getters
/// and change them through the verbs below, which keep its index slot, its namespace's and
/// its pool's accounting in step (the compiler enforces it).
#[derive(Debug, Clone)]
pub struct Entry {
    /// Inode, also its generation: unique for the daemon's life.
    ino: u64,
    /// Namespace.
    ns: String,
    /// Key.
    key: String,
    /// Pool.
    pool: PoolIdx,
    /// Where its bytes are in its pool.
    place: Place,
    /// Bytes.
    size: u64,
    /// Bytes reserved in the pool.
    asize: u64,
    /// Protected from eviction by the operator (persistent).
    pinned: bool,
    /// Holds of client sessions (`Op::Hold`, every session's together): protected from
    /// eviction while > 0. Not persistent: sessions do not outlive the daemon.
    holds: u32,
    /// Place in the LRU order.
    lru: Stamp,
    /// The client session that stored it, while connected.
    owner: Option<SessionId>,
    /// Leases on its extent (raw pools): retrievals whose mappings are alive.
    leases: u32,
    /// Owner, group and mode.
    perm: Perm,
    /// Publication time.
    mtime: SystemTime,
    /// Published by another host sharing the pool (cluster mode): the revision at which the
    /// authority created it (its identity there). Its extent is not this host's to free, and
    /// this host never evicts it.
    remote: Option<i64>,
    /// Clients of other hosts pin this host's entry (cluster mode): not evicted while they do.
    pinned_elsewhere: bool,
    /// Another host's entry not read here yet: on a pool without coherence across hosts, its
    /// stale cache lines are dropped before the first read (`State::ready_remote`).
    cold: bool,
    /// A delete's round trip to the authority is on its way (cluster mode): not evicted,
    /// renamed or deleted again meanwhile.
    withdrawing: bool,
}

impl AsMut<Stamp> for Entry {
    fn as_mut(&mut self) -> &mut Stamp {
        &mut self.lru
    }
}

impl Entry {
    /// A sealed entry of `size` bytes at `place` of `pool`, published now: not pinned, held
    /// or leased, nobody's session's, this host's; its room in the pool is `size` rounded up
    /// to the pool's alignment.
    pub fn new(
        ino: u64,
        ns: &str,
        key: &str,
        pool: PoolIdx,
        place: Place,
        size: u64,
        perm: Perm,
    ) -> Self {
        Entry {
            ino,
            ns: ns.to_owned(),
            key: key.to_owned(),
            pool,
            place,
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

    /// Its inode, also its generation.
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Its namespace.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// Its key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its pool.
    pub fn pool(&self) -> PoolIdx {
        self.pool
    }

    /// Where its bytes are in its pool.
    pub fn place(&self) -> Place {
        self.place
    }

    /// Its bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bytes it takes in its pool.
    pub fn asize(&self) -> u64 {
        self.asize
    }

    /// Pinned by the operator.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Its place in the LRU order (changed by the order only: `AsMut<Stamp>`).
    pub fn lru(&self) -> Stamp {
        self.lru
    }

    /// The holds of client sessions on it, every session's together.
    pub fn holds(&self) -> u32 {
        self.holds
    }

    /// Its owner, group and mode.
    pub fn perm(&self) -> Perm {
        self.perm
    }

    /// Another host's entry: which (the revision at which the authority created it, and its
    /// extent's offset).
    pub fn remote(&self) -> Option<SharedId> {
        self.remote.map(|created| SharedId {
            created,
            offset: self.place.wire(),
        })
    }

    /// A delete's round trip to the authority is on its way.
    pub fn withdrawing(&self) -> bool {
        self.withdrawing
    }

    /// Recovered from its pool's record: pinned as it was, published when it was.
    pub fn recovered(self, pinned: bool, mtime: SystemTime) -> Self {
        Entry {
            pinned,
            mtime,
            ..self
        }
    }

    /// Published by another host (its creation revision `created`), not read here yet.
    pub fn published_elsewhere(self, created: i64) -> Self {
        Entry {
            remote: Some(created),
            cold: true,
            ..self
        }
    }

    /// Stored by client session `owner` (None: through the mount), taking `asize` bytes of
    /// its pool.
    pub fn stored_by(self, owner: Option<SessionId>, asize: u64) -> Self {
        Entry {
            owner,
            asize,
            ..self
        }
    }

    /// Placed at `place` of its pool (its pool answered where it sealed it).
    pub fn at(self, place: Place) -> Self {
        Entry { place, ..self }
    }

    /// Client session `session` is gone: it owns the entry no more.
    pub fn disown(&mut self, session: SessionId) {
        if self.owner == Some(session) {
            self.owner = None;
        }
    }

    /// One more hold (of a session that counts its own); fails when the count would
    /// overflow.
    pub fn add_hold(&mut self) -> Result<()> {
        self.holds = self.holds.checked_add(1).ok_or_else(|| {
            maru::Error::InvalidArgument(format!("{}/{}: too many holds", self.ns, self.key))
        })?;
        Ok(())
    }

    /// `n` holds fewer (never below none).
    pub fn drop_holds(&mut self, n: u32) {
        self.holds = self.holds.saturating_sub(n);
    }

    /// One more lease (a retrieval here maps it, or a handle of the mount has it open).
    pub fn lease(&mut self) {
        self.leases += 1;
    }

    /// Marks (or no longer) a delete's round trip to the authority on its way.
    pub fn set_withdrawing(&mut self, withdrawing: bool) {
        self.withdrawing = withdrawing;
    }

    /// Marks it pinned (or no longer) by clients of other hosts; the caller writes its index
    /// slot's flags (`State::index_flags`).
    pub fn set_pinned_elsewhere(&mut self, pinned: bool) {
        self.pinned_elsewhere = pinned;
    }

    /// Marks it pinned (or no longer) by the operator; the caller writes its index slot's
    /// flags and its pool's record.
    pub fn set_pinned(&mut self, pinned: bool) {
        self.pinned = pinned;
    }

    /// Its owner, group and mode change (its pool's record already did).
    pub fn set_perm(&mut self, perm: Perm) {
        self.perm = perm;
    }

    /// Whether it was not read here yet since another host published it (its stale lines
    /// not dropped yet).
    pub fn cold(&self) -> bool {
        self.cold
    }

    /// Its stale lines were dropped: readers from now on read it as it is.
    pub fn set_warm(&mut self) {
        self.cold = false;
    }

    /// What its pool needs to know of it.
    pub fn loc(&self) -> Loc<'_> {
        Loc {
            ns: &self.ns,
            key: &self.key,
            place: self.place,
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
            offset: self.place.wire(),
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
        self.kept() || self.remote.is_some()
    }

    /// Whether something keeps it whoever published it: pinned, held (here or on other
    /// hosts), leased, or being withdrawn. Another host's entry that nothing keeps is evicted
    /// here only once its publisher is gone for good ([`Authority::orphaned`]).
    ///
    /// [`Authority::orphaned`]: crate::store::authority::Authority::orphaned
    pub fn kept(&self) -> bool {
        self.pinned
            || self.holds > 0
            || self.pinned_elsewhere
            || self.leases > 0
            || self.withdrawing
    }

    /// Where it is, for a client.
    pub fn located(&self, fd: bool) -> Located {
        Located {
            key: self.key.clone(),
            generation: self.ino,
            pool: self.pool.get(),
            offset: self.place.wire(),
            size: self.size,
            pinned: self.pinned,
            holds: self.holds,
            fd,
        }
    }
}

/// Why a sealed entry goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Deleted here (the authority releases its name: for every host).
    Deleted,
    /// Evicted here.
    Evicted,
    /// Removed by another host sharing the authority (its name is already released).
    Elsewhere,
    /// Another host's entry that gave way to this host's publication `to` of its name,
    /// granted by the authority (its removal elsewhere is still on its way): the name stays
    /// `to`'s.
    GaveWay { to: u64 },
    /// Deleted (or, `evicted`, evicted) here, its removal already recorded at the authority
    /// ([`Authority::withdraw`](super::authority::Authority::withdraw)).
    Withdrawn { w: Withdrawn, evicted: bool },
}
