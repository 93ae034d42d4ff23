//! The store's identifiers that are not plain numbers to its code: a client session is not an
//! inode, an allocation or an offset, and the compiler keeps them apart.

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
