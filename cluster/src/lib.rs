//! maru's cluster metadata on etcd (v3): the record several hosts sharing one pool agree on.
//!
//! Layout, under `/maru/<pool uuid>/` (the pool's device header UUID is its identity):
//!
//! | key | value | bound to |
//! |---|---|---|
//! | `nodes/<node>` | [`NodeInfo`] (JSON) | the node's lease |
//! | `beats/<node>` | the TTL etcd granted at the node's last renewal (decimal seconds), rewritten at each | the node's lease |
//! | `regions/<unit, 16 hex digits>` | the claiming node's name | the claiming node's lease |
//! | `entries/<namespace>/<entry name>` | [`EntryRecord`] (JSON) | nothing: sealed entries outlive hosts |
//! | `maps/<unit>/<extent offset>/<node>/<tag>` | empty | the mapping node's lease |
//! | `acks/<node>` | the revision of entries the node has applied (decimal) | the node's lease |
//! | `pins/<namespace>/<entry name>` | empty | nothing: a pin lasts until unpinned or removed |
//! | `clientpins/<namespace>/<entry name>/<node>` | empty: clients of the node pin the entry | the node's lease |
//! | `reserved/<namespace>/<entry name>` | the node writing it | that node's lease |
//! | `quotas/<namespace>` | bytes (decimal) | nothing: until cleared |
//! | `access/<publisher>/<reader>` | the publisher's entries the reader used lately (JSON) | the reader's lease |
//!
//! - **Membership**: [`Member::join`] grants a lease of `ttl` seconds, keeps it alive, and
//!   creates `nodes/<node>` under it (refused while another live host holds the name).
//!   Each renewal rewrites `beats/<node>`; a host that sees another's beat unchanged for
//!   longer than its TTL deletes it (if still unchanged) and revokes that lease itself,
//!   rather than wait for etcd, whose release of an expired lease can come seconds late.
//! - **Region claims**: [`Member::claim`] creates `regions/<unit>` for every 2 MiB unit of a
//!   range under the lease, all or nothing, if none is held; a host that dies or is cut off
//!   loses its claims when the lease expires.
//! - **Write-once publication**: [`Member::publish`] creates `entries/<ns>/<name>` only if
//!   absent, only while this host's lease is the one on `nodes/<node>`, and only if the
//!   entry's units are claimed by this host: one transaction, so of two hosts publishing a
//!   key at once exactly one wins, a host whose lease expired publishes nothing (it must
//!   [`Member::rejoin`]), and no entry is published into units another host took meanwhile.
//! - **Leases on extents**: a removal ([`Member::remove`]) is acknowledged by every other
//!   live host once it has applied it ([`Member::acknowledge`], `acks/<node>`), and a host
//!   whose clients still map the removed extent records, in the same step and before its
//!   acknowledgement, a *hold* on it (a key per 2 MiB unit of the extent, under its lease).
//!   The publisher frees a removed entry's extent only once every live host acknowledged the
//!   removal ([`Member::acknowledged`]) and no hold is left ([`Member::held`]); a fresh claim
//!   ([`Member::claim`]) is refused over a unit any host holds.
//! - **Pins**: [`Member::pin`] records a pin only while the entry exists; a removal takes it
//!   with the entry; [`Member::pins`] and [`Member::watch_pins`] keep every host's view.
//! - **Client pins**: a host whose clients pin another host's entry (the original API's pin
//!   counts) records it under its lease ([`Member::pin_for_clients`]); the publisher follows
//!   them ([`Member::client_pins`], [`Member::watch_client_pins`]) and does not evict an entry
//!   any host's clients pin.
//! - **Access reports**: a host reports in batches which of another host's entries it used
//!   ([`Member::report_access`]); the publisher, which alone evicts them, watches its reports
//!   ([`Member::watch_access`]) to keep one LRU order for the whole cluster.
//! - **Visibility**: [`Member::snapshot`] reads every entry at one revision and
//!   [`Member::watch_entries`] streams every change after it, so a host's view misses nothing.
//!
//! The async API runs on the caller's tokio runtime.

pub mod etcd;
pub mod testing;

mod batch;
mod claims;
mod detector;
mod error;
mod keys;
mod lease;
mod member;
mod records;
mod watch;

pub use batch::Publication;
pub use error::{Error, Result};
pub use keys::UNIT;
pub use lease::boottime_ns;
pub use member::{Member, Rejoined};
pub use records::{
    EntryAt, EntryEvent, EntryRecord, Listed, NodeInfo, Published, Removed, Removing, Snapshot,
};
pub use watch::{AccessWatch, AckWatch, ClientPinWatch, EntryWatch, PinWatch, QuotaWatch};
