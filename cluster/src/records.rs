//! The records hosts write in etcd and read back, and what the calls answer.

use serde::{Deserialize, Serialize};

/// A member host, as `nodes/<node>` records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node: String,
    /// Where the host's marud can be told about (free text: host name, address).
    pub address: String,
    pub pid: u32,
}

/// A sealed entry: where its bytes are in the shared pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryRecord {
    /// Byte offset in the pool.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The node that published it.
    pub node: String,
    /// The publishing host's allocation id (unique per host and pool).
    pub alloc: u64,
}

/// The outcome of [`crate::Member::publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Published at this etcd revision.
    New { revision: i64 },
    /// The key existed: the first writer's record, created at etcd revision `created` (the
    /// caller frees its allocation, unless the record is its own).
    Exists { record: EntryRecord, created: i64 },
    /// Another host reserved the name for a writer of its own ([`crate::Member::reserve`]).
    Reserved(String),
}

/// An entry as [`crate::Member::snapshot`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub ns: String,
    pub name: String,
    pub record: EntryRecord,
    /// The revision that created it (its key is written once).
    pub revision: i64,
}

/// Every entry at one revision, as [`crate::Member::snapshot`] read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub entries: Vec<Listed>,
    /// The revision read at: watch from the next one to miss nothing.
    pub revision: i64,
    /// The removals not yet acknowledged by every live host (their tombstones): the revision
    /// of the newest removal of the extent at each offset. A removal of an extent not here
    /// was acknowledged by every host live when its tombstone went.
    pub removals: std::collections::HashMap<u64, i64>,
    /// The validity a view of the entries as fresh as this read earns, as a tick does
    /// ([`EntryEvent::Tick`]): the moment it was asked, plus the TTL, less the guard.
    pub fresh_until: u64,
}

impl Snapshot {
    /// The revision at which the entry created at `created`, whose extent is at `offset`
    /// and which this snapshot no longer has, was removed, or a revision every live host
    /// has acknowledged if that removal's tombstone is gone: what the entry's publisher waits
    /// for every live host to acknowledge before it frees the extent. Never the snapshot's
    /// own revision, which hosts acknowledge only once the entries change after it.
    pub fn removed_at(&self, offset: u64, created: i64) -> i64 {
        self.removals
            .get(&offset)
            .copied()
            .filter(|&r| r > created)
            .unwrap_or(created + 1)
    }
}

/// What [`crate::Member::remove`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    /// The entry was there (and is gone now).
    pub existed: bool,
    /// The revision of the removal (when the entry was gone already, of the removal that
    /// took it, or one every live host has acknowledged): the publisher frees the extent
    /// once every other live host acknowledged it ([`crate::Member::acknowledged`]) and none
    /// holds it ([`crate::Member::held`]).
    pub revision: i64,
}

/// A change to the entries, from [`crate::EntryWatch::next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryEvent {
    Put {
        ns: String,
        name: String,
        record: EntryRecord,
        /// The revision that created it (its key is written once).
        revision: i64,
    },
    Delete {
        ns: String,
        name: String,
        /// The revision of the removal.
        revision: i64,
        /// The revision that created the entry removed.
        created: i64,
        /// The record removed (None if etcd no longer had it to tell).
        record: Option<EntryRecord>,
    },
    /// Host `node` wrote its tick, at `revision`, with each renewal of its lease and each
    /// claim: `until` is then until when that host's view of the entries counts as fresh
    /// once it has seen the tick ([`crate::boottime_ns`] of that host, so only that host
    /// can tell it: the moment it asked, plus the TTL, less the guard). A host that sees
    /// its own tick has seen every change to the entries made before it asked. A claim
    /// renews no lease: only a renewal's tick tells of the lease, and the host counts its
    /// lease's validity from the renewals themselves.
    Tick {
        node: String,
        until: u64,
        revision: i64,
    },
}

/// One removal of [`crate::Member::remove_many`].
#[derive(Debug, Clone, Copy)]
pub struct Removing<'a> {
    pub ns: &'a str,
    pub name: &'a str,
    /// The entry meant, as the caller knows it; None: whichever is there (read first).
    pub entry: Option<EntryAt>,
}

/// Which entry of a name, and where its bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryAt {
    /// The revision that created it.
    pub created: i64,
    pub offset: u64,
    pub len: u64,
}

impl EntryAt {
    pub fn of(created: i64, record: &EntryRecord) -> Self {
        EntryAt {
            created,
            offset: record.offset,
            len: record.len,
        }
    }
}
