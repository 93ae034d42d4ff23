//! What the cluster metadata can fail with.

use crate::etcd;

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// etcd could not be reached or refused the request.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd::Error),
    /// Another live host holds this node name.
    #[error("node name {0:?} is held by a live host")]
    NodeTaken(String),
    /// This host's lease expired or was revoked: it must rejoin before it claims or publishes.
    #[error("node {0:?} lost its etcd lease; rejoin first")]
    LeaseLost(String),
    /// A record in etcd is not what this version writes.
    #[error("bad record at {key}: {why}")]
    BadRecord { key: String, why: String },
    /// A publication of bytes outside the units this host holds (it lost them while cut off).
    #[error("{offset:#x}+{len:#x} is not in regions this host holds")]
    NotClaimed { offset: u64, len: u64 },
    /// A name that cannot be a key component.
    #[error("invalid name {0:?}")]
    InvalidName(String),
    /// A range of the pool that is not whole claim units.
    #[error("range {offset:#x}+{len:#x} is not whole 2 MiB units")]
    Misaligned { offset: u64, len: u64 },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether the request never reached etcd ([`etcd::Error::never_sent`]): it did nothing.
    pub fn never_sent(&self) -> bool {
        matches!(self, Error::Etcd(e) if e.never_sent())
    }
}
