//! The store's identifiers that are not plain numbers to its code: a client session is not a
//! pool, an inode or an allocation, and where an entry's bytes are (a raw pool's extent, a
//! memfs file's inode, a piece of a pack) is not one `u64`; the compiler keeps them apart.

use std::fmt;

/// A client session of the store: a connection on the control socket (or of the remote
/// tier), or the mount's writers ([`SessionId::MOUNT`]). Only the store makes new ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(u64);

impl SessionId {
    /// The mount's writers: never opened, never closed.
    pub const MOUNT: SessionId = SessionId(0);

    /// The session after this one (the store numbers them in order).
    pub(super) fn next(self) -> SessionId {
        SessionId(self.0 + 1)
    }

    /// Its number, as `maructl clients` and the metrics show it.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One of the store's pools: its place in the order marud was given them (`--pool`), which
/// clients see as a grant's or a location's `pool`. Only the store makes them, from the pools
/// it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolIdx(u32);

impl PoolIdx {
    /// The pool at `i` of the store's pools.
    pub(super) fn at(i: usize) -> PoolIdx {
        PoolIdx(u32::try_from(i).expect("fewer than 2^32 pools"))
    }

    /// Its number on the wire.
    pub fn get(self) -> u32 {
        self.0
    }

    /// Its place in the store's list of pools.
    pub(super) fn slot(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PoolIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Which entry of the shared pool (cluster mode): the revision of the authority that created
/// it and its offset in the pool. The revision alone does not tell entries apart: one
/// transaction publishes several at one revision (the group commit's; seed 1726: a removal of
/// one refused its sibling to every reader of a host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SharedId {
    pub created: i64,
    pub offset: u64,
}

/// Where a sealed entry's bytes are in its pool: three things that clients and the pools'
/// logs carry as one `u64` (its location, [`Place::wire`]), and the store keeps apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// At this offset of a raw pool's device.
    Extent(u64),
    /// In a file of its own in a memfs pool, whose inode number this is.
    File(u64),
    /// In pack `pack` of a memfs pool, at `offset` of the pack's file.
    Packed { pack: u32, offset: u64 },
}

impl Place {
    /// Not placed yet: what a pool's publication is given, to answer where.
    pub const NOWHERE: Place = Place::Extent(0);

    /// The `u64` clients and the pools' logs carry.
    pub fn wire(self) -> u64 {
        match self {
            Place::Extent(o) | Place::File(o) => o,
            Place::Packed { pack, offset } => maru::index::pack_location(pack, offset),
        }
    }

    /// The offset in a raw pool's device.
    pub fn extent(self) -> Option<u64> {
        match self {
            Place::Extent(o) => Some(o),
            _ => None,
        }
    }

    /// The pack and the offset in it.
    pub fn packed(self) -> Option<(u32, u64)> {
        match self {
            Place::Packed { pack, offset } => Some((pack, offset)),
            _ => None,
        }
    }
}
