//! maru's cluster metadata on etcd (v3): the record several hosts sharing one pool agree on.
//!
//! Layout, under `/maru/<pool uuid>/` (the pool's device header UUID is its identity):
//!
//! | key | value | bound to |
//! |---|---|---|
//! | `nodes/<node>` | [`NodeInfo`] (JSON) | the node's lease |
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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd::{Client, Compare, EventType, Op, Range, Txn, TxnResponse, WatchStream};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

pub mod etcd;
pub mod testing;

/// The unit of region claims: 2 MiB, the pool's region alignment.
pub const UNIT: u64 = 2 << 20;

/// Units claimed per etcd transaction: etcd's default `--max-txn-ops` (128) bounds the
/// comparisons of one transaction; one more checks the lease, and a fresh claim's check of
/// the mappings is one more still.
const UNITS_PER_TXN: usize = 126;

/// The unit indexes of `[offset, offset + len)`.
fn units(offset: u64, len: u64) -> Result<Vec<u64>> {
    if len == 0 || !offset.is_multiple_of(UNIT) || !len.is_multiple_of(UNIT) {
        return Err(Error::Misaligned { offset, len });
    }
    Ok((offset / UNIT..(offset + len) / UNIT).collect())
}

/// The units a publication checks this host holds: every unit of the entry, or for an entry
/// of more units than a transaction can compare, its first and last 60.
fn held_units(offset: u64, len: u64) -> Vec<u64> {
    let (first, last) = (offset / UNIT, (offset + len.max(1) - 1) / UNIT);
    if last - first < 120 {
        (first..=last).collect()
    } else {
        (first..first + 60).chain(last - 59..=last).collect()
    }
}

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

/// The outcome of [`Member::publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Published at this etcd revision.
    New { revision: i64 },
    /// The key existed: the first writer's record (the caller frees its allocation).
    Exists(EntryRecord),
    /// Another host reserved the name for a writer of its own ([`Member::reserve`]).
    Reserved(String),
}

/// An entry as [`Member::snapshot`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub ns: String,
    pub name: String,
    pub record: EntryRecord,
    /// The revision that created it (its key is written once).
    pub revision: i64,
}

/// What [`Member::remove`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    /// The entry was there (and is gone now).
    pub existed: bool,
    /// The revision of the removal: the publisher frees the extent once every other live
    /// host acknowledged it ([`Member::acknowledged`]) and none holds it ([`Member::held`]).
    pub revision: i64,
}

/// A change to the entries, from [`EntryWatch::next`].
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
}

fn check_name(s: &str) -> Result<()> {
    if s.is_empty() || s.contains('/') || s.contains('\0') {
        return Err(Error::InvalidName(s.to_owned()));
    }
    Ok(())
}

fn check_ns(ns: &str) -> Result<()> {
    for part in ns.split('/') {
        check_name(part)?;
    }
    Ok(())
}

/// The key prefixes of one pool.
#[derive(Debug, Clone)]
struct Keys {
    root: String,
}

impl Keys {
    fn node(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.root)
    }
    fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }
    fn region(&self, index: u64) -> String {
        format!("{}regions/{index:016x}", self.root)
    }
    fn regions(&self) -> String {
        format!("{}regions/", self.root)
    }
    fn entry(&self, ns: &str, name: &str) -> String {
        format!("{}entries/{ns}/{name}", self.root)
    }
    fn entries(&self) -> String {
        format!("{}entries/", self.root)
    }
    fn pin(&self, ns: &str, name: &str) -> String {
        format!("{}pins/{ns}/{name}", self.root)
    }
    fn pins(&self) -> String {
        format!("{}pins/", self.root)
    }
    fn client_pin(&self, ns: &str, name: &str, node: &str) -> String {
        format!("{}clientpins/{ns}/{name}/{node}", self.root)
    }
    fn client_pins(&self) -> String {
        format!("{}clientpins/", self.root)
    }
    /// `(namespace, name, node)` of a client pin's key.
    fn split_client_pin(&self, key: &[u8]) -> Result<(String, String, String)> {
        let (rest, node) = Self::split_name(&self.client_pins(), key)?;
        let (ns, name) = rest
            .rsplit_once('/')
            .ok_or_else(|| bad(key, "no namespace".into()))?;
        Ok((ns.to_owned(), name.to_owned(), node))
    }
    fn reservation(&self, ns: &str, name: &str) -> String {
        format!("{}reserved/{ns}/{name}", self.root)
    }
    fn quota(&self, ns: &str) -> String {
        format!("{}quotas/{ns}", self.root)
    }
    fn quotas(&self) -> String {
        format!("{}quotas/", self.root)
    }
    fn ack(&self, node: &str) -> String {
        format!("{}acks/{node}", self.root)
    }
    fn acks(&self) -> String {
        format!("{}acks/", self.root)
    }
    fn access_to(&self, publisher: &str) -> String {
        format!("{}access/{publisher}/", self.root)
    }
    /// Every unit from `unit` on, in key order (fixed-width hex).
    fn maps_from(&self, unit: u64) -> String {
        format!("{}maps/{unit:016x}/", self.root)
    }
    /// The holds of the extent at `offset` (under its first unit).
    fn maps_of(&self, offset: u64) -> String {
        format!("{}{offset:016x}/", self.maps_from(offset / UNIT))
    }
    fn map(&self, unit: u64, offset: u64, node: &str, tag: u64) -> String {
        format!("{}maps/{unit:016x}/{offset:016x}/{node}/{tag}", self.root)
    }
    /// `(namespace, name)` of an entry key (names never contain `/`; namespaces may).
    fn split_entry(&self, key: &[u8]) -> Result<(String, String)> {
        Self::split_name(&self.entries(), key)
    }

    /// `(namespace, name)` of a key under `prefix`.
    fn split_name(prefix: &str, key: &[u8]) -> Result<(String, String)> {
        let s = std::str::from_utf8(key).map_err(|e| bad(key, e.to_string()))?;
        let rest = s
            .strip_prefix(prefix)
            .ok_or_else(|| bad(key, format!("outside {prefix}")))?;
        let (ns, name) = rest
            .rsplit_once('/')
            .ok_or_else(|| bad(key, "no namespace".into()))?;
        Ok((ns.to_owned(), name.to_owned()))
    }
}

fn bad(key: &[u8], why: String) -> Error {
    Error::BadRecord {
        key: String::from_utf8_lossy(key).into_owned(),
        why,
    }
}

fn decode<T: for<'a> Deserialize<'a>>(key: &[u8], value: &[u8]) -> Result<T> {
    serde_json::from_slice(value).map_err(|e| bad(key, e.to_string()))
}

/// One host's membership of a pool's cluster.
pub struct Member {
    client: Client,
    keys: Keys,
    info: NodeInfo,
    ttl: i64,
    lease: i64,
    live: Arc<AtomicBool>,
    keeper: JoinHandle<()>,
}

impl Member {
    /// Joins the cluster of pool `pool_uuid` as `info.node`, with a lease of `ttl` seconds
    /// kept alive in the background.
    ///
    /// # Errors
    ///
    /// [`Error::NodeTaken`] while another live host holds the name; [`Error::Etcd`].
    pub async fn join(
        endpoints: &[String],
        pool_uuid: &str,
        info: NodeInfo,
        ttl: Duration,
    ) -> Result<Self> {
        check_name(pool_uuid)?;
        check_name(&info.node)?;
        let ttl = ttl.as_secs().max(1) as i64;
        // A request that cannot finish within the TTL (2 s at least) fails rather than hang:
        // a host cut off from etcd learns it about when its lease runs out.
        let patience = Duration::from_secs((ttl as u64).max(2));
        let client = Client::connect(
            endpoints,
            etcd::Options {
                patience,
                require_leader: true,
            },
        )?;
        let keys = Keys {
            root: format!("/maru/{pool_uuid}/"),
        };
        let (lease, live, keeper) = Self::register(&client, &keys, &info, ttl).await?;
        Ok(Member {
            client,
            keys,
            info,
            ttl,
            lease,
            live,
            keeper,
        })
    }

    async fn register(
        client: &Client,
        keys: &Keys,
        info: &NodeInfo,
        ttl: i64,
    ) -> Result<(i64, Arc<AtomicBool>, JoinHandle<()>)> {
        let c = client.clone();
        let lease = c.lease_grant(ttl).await?;
        let key = keys.node(&info.node);
        let value = serde_json::to_vec(info).expect("serializable");
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([Op::put(key, value, lease)]);
        if !c.txn(txn).await?.succeeded() {
            let _ = c.lease_revoke(lease).await;
            return Err(Error::NodeTaken(info.node.clone()));
        }
        let live = Arc::new(AtomicBool::new(true));
        let keeper = tokio::spawn(keep_alive(c, lease, ttl, live.clone(), info.node.clone()));
        Ok((lease, live, keeper))
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.info.node
    }

    /// This host's etcd lease id.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// False once the lease is known lost (the keep-alive saw it expire or etcd was
    /// unreachable past the TTL). Claims and publications also check it in etcd itself.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Joins again after the lease was lost: a new lease, the node record recreated. What
    /// the old lease held (claims) is gone; the caller re-claims what it needs.
    pub async fn rejoin(&mut self) -> Result<()> {
        self.keeper.abort();
        let (lease, live, keeper) =
            Self::register(&self.client, &self.keys, &self.info, self.ttl).await?;
        self.lease = lease;
        self.live = live;
        self.keeper = keeper;
        Ok(())
    }

    /// The comparison that holds only while this host's lease owns its node record.
    fn alive_cmp(&self) -> Compare {
        Compare::lease_is(self.keys.node(&self.info.node), self.lease)
    }

    /// Claims `[offset, offset + len)` of the pool for this host to carve afresh, every 2 MiB
    /// unit of it ([`UNIT`]; both must be multiples), all or nothing; false if another host
    /// holds any unit of it, or any host still maps an extent there (a removed entry another
    /// host has not let go of): nothing is claimed then.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when this host's lease is gone; [`Error::InvalidName`] for a
    /// range that is not whole units.
    pub async fn claim(&self, offset: u64, len: u64) -> Result<bool> {
        self.claim_range(offset, len, true).await
    }

    /// Claims again units that hold this host's own entries (after a restart, or a rejoin):
    /// as [`Member::claim`], but other hosts' mappings of those entries do not stand in the way.
    pub async fn claim_again(&self, offset: u64, len: u64) -> Result<bool> {
        self.claim_range(offset, len, false).await
    }

    async fn claim_range(&self, offset: u64, len: u64, fresh: bool) -> Result<bool> {
        let units = units(offset, len)?;
        let mut done = 0;
        for piece in units.chunks(UNITS_PER_TXN) {
            if !self.claim_units(piece, fresh).await? {
                // Another host holds a unit: give back what this call took, claim nothing.
                self.release_units(&units[..done]).await?;
                return Ok(false);
            }
            done += piece.len();
        }
        Ok(true)
    }

    async fn claim_units(&self, units: &[u64], fresh: bool) -> Result<bool> {
        let mut when = vec![self.alive_cmp()];
        if let (true, Some(first), Some(last)) = (fresh, units.first(), units.last()) {
            // No key in the range: etcd compares a range's absent keys as created at 0.
            when.push(Compare::none_in(
                self.keys.maps_from(*first),
                self.keys.maps_from(last + 1),
            ));
        }
        let mut then = Vec::with_capacity(units.len());
        for &u in units {
            let key = self.keys.region(u);
            when.push(Compare::absent(key.clone()));
            then.push(Op::put(key, self.info.node.clone(), self.lease));
        }
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
        let r = self.client.txn(txn).await?;
        if r.succeeded() {
            return Ok(true);
        }
        self.check_alive(&r)?;
        Ok(false)
    }

    /// Gives `[offset, offset + len)` back: the units this host holds in it (others' stay).
    pub async fn release(&self, offset: u64, len: u64) -> Result<()> {
        self.release_units(&units(offset, len)?).await
    }

    async fn release_units(&self, units: &[u64]) -> Result<()> {
        for &u in units {
            self.delete_if_mine(self.keys.region(u)).await?;
        }
        Ok(())
    }

    /// Deletes `key` if its value is this node's name (a claim or reservation of its own).
    async fn delete_if_mine(&self, key: String) -> Result<()> {
        let txn = Txn::new()
            .when([Compare::value_is(key.clone(), self.info.node.clone())])
            .and_then([Op::delete(key)]);
        self.client.txn(txn).await?;
        Ok(())
    }

    /// Every claimed unit (by index: offset / [`UNIT`]) and its holder.
    pub async fn regions(&self) -> Result<BTreeMap<u64, String>> {
        let prefix = self.keys.regions();
        let r = self.client.get(prefix.clone(), Range::PREFIX).await?;
        let mut out = BTreeMap::new();
        for kv in r.kvs {
            let hex = &kv.key.as_slice()[prefix.len()..];
            let index = std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad(kv.key.as_slice(), "not a region index".into()))?;
            out.insert(
                index,
                String::from_utf8_lossy(kv.value.as_slice()).into_owned(),
            );
        }
        Ok(out)
    }

    /// The live members.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        let r = self.client.get(self.keys.nodes(), Range::PREFIX).await?;
        r.kvs
            .iter()
            .map(|kv| decode(kv.key.as_slice(), kv.value.as_slice()))
            .collect()
    }

    /// Publishes entry `ns/name` if absent: write-once across hosts, refused (in the same
    /// transaction) unless this host's lease is live.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`]: nothing was published; [`Error::Etcd`]: the outcome is unknown
    /// only if etcd failed after applying it (read the key to learn).
    pub async fn publish(&self, ns: &str, name: &str, record: &EntryRecord) -> Result<Published> {
        self.publish_as(ns, name, record, false).await
    }

    /// Publishes entry `ns/name`, which this host reserved ([`Member::reserve`]), as
    /// [`Member::publish`] does; the reservation goes in the same transaction.
    pub async fn publish_reserved(
        &self,
        ns: &str,
        name: &str,
        record: &EntryRecord,
    ) -> Result<Published> {
        self.publish_as(ns, name, record, true).await
    }

    async fn publish_as(
        &self,
        ns: &str,
        name: &str,
        record: &EntryRecord,
        reserved: bool,
    ) -> Result<Published> {
        check_ns(ns)?;
        check_name(name)?;
        let key = self.keys.entry(ns, name);
        let rkey = self.keys.reservation(ns, name);
        let value = serde_json::to_vec(record).expect("serializable");
        let mut when = vec![
            self.alive_cmp(),
            Compare::absent(key.clone()),
            if reserved {
                Compare::value_is(rkey.clone(), self.info.node.clone())
            } else {
                Compare::absent(rkey.clone())
            },
        ];
        for u in held_units(record.offset, record.len) {
            when.push(Compare::value_is(
                self.keys.region(u),
                self.info.node.clone(),
            ));
        }
        let txn = Txn::new()
            .when(when)
            .and_then([Op::put(key.clone(), value, 0), Op::delete(rkey.clone())])
            .or_else([
                Op::get(self.keys.node(&self.info.node), Range::KEY),
                Op::get(key.clone(), Range::KEY),
                Op::get(rkey, Range::KEY),
            ]);
        let r = self.client.txn(txn).await?;
        if r.succeeded() {
            return Ok(Published::New {
                revision: r.revision(),
            });
        }
        self.check_alive(&r)?;
        if let Some(p) = self.name_taken(&r)? {
            return Ok(p);
        }
        // Alive, the name free: the entry is not (all) in units this host holds.
        Err(Error::NotClaimed {
            offset: record.offset,
            len: record.len,
        })
    }

    /// From a failed transaction's reads (this node, the entry, its reservation): who took
    /// the name, if anyone did.
    fn name_taken(&self, r: &TxnResponse) -> Result<Option<Published>> {
        if let Some(g) = r.range(1)
            && let Some(kv) = g.kvs.first()
        {
            return Ok(Some(Published::Exists(decode(
                kv.key.as_slice(),
                kv.value.as_slice(),
            )?)));
        }
        if let Some(g) = r.range(2)
            && let Some(kv) = g.kvs.first()
            && kv.value.as_slice() != self.info.node.as_bytes()
        {
            let holder = String::from_utf8_lossy(kv.value.as_slice()).into_owned();
            return Ok(Some(Published::Reserved(holder)));
        }
        Ok(None)
    }

    /// Reserves name `ns/name` for a writer of this host whose publication follows later (a
    /// writer through the mount: its `close` reports the outcome, its release publishes):
    /// no other host can publish or reserve it meanwhile. Bound to this host's lease; a
    /// reservation this host holds already is kept. `None` when reserved; otherwise who has
    /// the name ([`Published::Exists`] or [`Published::Reserved`]).
    pub async fn reserve(&self, ns: &str, name: &str) -> Result<Option<Published>> {
        check_ns(ns)?;
        check_name(name)?;
        let (key, rkey) = (self.keys.entry(ns, name), self.keys.reservation(ns, name));
        let txn = Txn::new()
            .when([
                self.alive_cmp(),
                Compare::absent(key.clone()),
                Compare::absent(rkey.clone()),
            ])
            .and_then([Op::put(rkey.clone(), self.info.node.clone(), self.lease)])
            .or_else([
                Op::get(self.keys.node(&self.info.node), Range::KEY),
                Op::get(key, Range::KEY),
                Op::get(rkey, Range::KEY),
            ]);
        let r = self.client.txn(txn).await?;
        if r.succeeded() {
            return Ok(None);
        }
        self.check_alive(&r)?;
        self.name_taken(&r)
    }

    /// Gives back a reservation of this host's (another's is left alone).
    pub async fn unreserve(&self, ns: &str, name: &str) -> Result<()> {
        self.delete_if_mine(self.keys.reservation(ns, name)).await
    }

    /// From a failed transaction's first read (this node's record): LeaseLost unless the
    /// record is there under this host's lease.
    fn check_alive(&self, r: &TxnResponse) -> Result<()> {
        let ours = r
            .range(0)
            .and_then(|g| g.kvs.first())
            .is_some_and(|kv| kv.lease == self.lease);
        if ours {
            Ok(())
        } else {
            self.live.store(false, Ordering::Release);
            Err(Error::LeaseLost(self.info.node.clone()))
        }
    }

    /// Removes entry `ns/name` only if its record is `record` (a publication whose outcome
    /// was unknown, taken back); true if it did.
    pub async fn retract(&self, ns: &str, name: &str, record: &EntryRecord) -> Result<bool> {
        check_ns(ns)?;
        check_name(name)?;
        let key = self.keys.entry(ns, name);
        let value = serde_json::to_vec(record).expect("serializable");
        let txn = Txn::new()
            .when([Compare::value_is(key.clone(), value)])
            .and_then([Op::delete(key)]);
        Ok(self.client.txn(txn).await?.succeeded())
    }

    /// Removes entry `ns/name` (and its pin), at the revision returned.
    pub async fn remove(&self, ns: &str, name: &str) -> Result<Removed> {
        check_ns(ns)?;
        check_name(name)?;
        let txn = Txn::new().and_then([
            Op::delete(self.keys.entry(ns, name)),
            Op::delete(self.keys.pin(ns, name)),
        ]);
        let r = self.client.txn(txn).await?;
        Ok(Removed {
            existed: r.deleted(0).is_some_and(|n| n > 0),
            revision: r.revision(),
        })
    }

    /// Acknowledges every change to the entries up to `revision` (this host applied them):
    /// first records `holds`, each an extent `(offset, len)` of a removed entry that clients
    /// here still map, as `tag` (unique on this host; a key per 2 MiB unit, under this host's
    /// lease), then `acks/<node>`. The publisher of a removed entry frees its extent only once
    /// every live host acknowledged the removal and no hold is left, so an extent a client
    /// maps is never carved again while it does.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when this host's lease is gone.
    pub async fn acknowledge(&self, revision: i64, holds: &[(u64, u64, u64)]) -> Result<()> {
        let mut puts: Vec<(String, String)> = holds
            .iter()
            .flat_map(|&(offset, len, tag)| self.hold_keys(offset, len, tag))
            .map(|k| (k, String::new()))
            .collect();
        puts.push((self.keys.ack(&self.info.node), revision.to_string()));
        for piece in puts.chunks(UNITS_PER_TXN) {
            let txn = Txn::new()
                .when([self.alive_cmp()])
                .and_then(
                    piece
                        .iter()
                        .map(|(k, v)| Op::put(k.clone(), v.clone(), self.lease))
                        .collect::<Vec<_>>(),
                )
                .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
            let r = self.client.txn(txn).await?;
            if !r.succeeded() {
                self.check_alive(&r)?;
            }
        }
        Ok(())
    }

    /// The least revision the other live hosts acknowledged ([`Member::acknowledge`]); a host
    /// that has acknowledged nothing yet counts as 0. None when no other host is live.
    pub async fn acknowledged(&self) -> Result<Option<i64>> {
        let txn = Txn::new().and_then([
            Op::get(self.keys.nodes(), Range::KEYS_UNDER),
            Op::get(self.keys.acks(), Range::PREFIX),
        ]);
        let r = self.client.txn(txn).await?;
        let (Some(nodes), Some(acks)) = (r.range(0), r.range(1)) else {
            return Err(bad(
                self.keys.acks().as_bytes(),
                "an unexpected reply".into(),
            ));
        };
        let acked: std::collections::HashMap<&[u8], i64> = acks
            .kvs
            .iter()
            .filter_map(|kv| {
                let node = kv
                    .key
                    .as_slice()
                    .strip_prefix(self.keys.acks().as_bytes())?;
                let rev = std::str::from_utf8(kv.value.as_slice())
                    .ok()?
                    .parse()
                    .ok()?;
                Some((node, rev))
            })
            .collect();
        let me = self.keys.node(&self.info.node);
        Ok(nodes
            .kvs
            .iter()
            .filter(|kv| kv.key.as_slice() != me.as_bytes())
            .filter_map(|kv| kv.key.as_slice().strip_prefix(self.keys.nodes().as_bytes()))
            .map(|node| acked.get(node).copied().unwrap_or(0))
            .min())
    }

    /// Streams a wakeup for every change to the acknowledgements (a host acknowledged, or
    /// left), from now on.
    pub async fn watch_acks(&self) -> Result<AckWatch> {
        let stream = self
            .client
            .watch(self.keys.acks(), Range::PREFIX, 0, false)
            .await?;
        Ok(AckWatch { stream })
    }

    /// Lets go of a hold [`Member::acknowledge`] recorded as `tag`.
    pub async fn unhold(&self, offset: u64, len: u64, tag: u64) -> Result<()> {
        self.delete_keys(&self.hold_keys(offset, len, tag)).await
    }

    fn hold_keys(&self, offset: u64, len: u64, tag: u64) -> Vec<String> {
        let (first, last) = (offset / UNIT, (offset + len.max(1) - 1) / UNIT);
        (first..=last)
            .map(|u| self.keys.map(u, offset, &self.info.node, tag))
            .collect()
    }

    async fn delete_keys(&self, keys: &[String]) -> Result<()> {
        for piece in keys.chunks(UNITS_PER_TXN) {
            let ops: Vec<Op> = piece.iter().map(|k| Op::delete(k.clone())).collect();
            self.client.txn(Txn::new().and_then(ops)).await?;
        }
        Ok(())
    }

    /// The extents (by offset) that some host maps, of those in `offsets`.
    pub async fn held(&self, offsets: &[u64]) -> Result<std::collections::HashSet<u64>> {
        let mut out = std::collections::HashSet::new();
        for piece in offsets.chunks(UNITS_PER_TXN) {
            let ops: Vec<Op> = piece
                .iter()
                .map(|&o| Op::get(self.keys.maps_of(o), Range::COUNT_UNDER))
                .collect();
            let r = self.client.txn(Txn::new().and_then(ops)).await?;
            for (i, &o) in piece.iter().enumerate() {
                if r.range(i).is_some_and(|g| g.count > 0) {
                    out.insert(o);
                }
            }
        }
        Ok(out)
    }

    /// Every entry, read at one revision (returned): watch from the next one to miss nothing.
    pub async fn snapshot(&self) -> Result<(Vec<Listed>, i64)> {
        let r = self.client.get(self.keys.entries(), Range::PREFIX).await?;
        let revision = r.header.map_or(0, |h| h.revision);
        let mut out = Vec::with_capacity(r.kvs.len());
        for kv in r.kvs {
            let (ns, name) = self.keys.split_entry(kv.key.as_slice())?;
            out.push(Listed {
                ns,
                name,
                record: decode(kv.key.as_slice(), kv.value.as_slice())?,
                revision: kv.create_revision,
            });
        }
        Ok((out, revision))
    }

    /// Pins entry `ns/name` for every host (its publisher never evicts it), or unpins it.
    /// False (nothing recorded) when pinning an entry that does not exist.
    pub async fn pin(&self, ns: &str, name: &str, pinned: bool) -> Result<bool> {
        check_ns(ns)?;
        check_name(name)?;
        let key = self.keys.pin(ns, name);
        let txn = if pinned {
            Txn::new()
                .when([Compare::present(self.keys.entry(ns, name))])
                .and_then([Op::put(key, Vec::new(), 0)])
        } else {
            Txn::new().and_then([Op::delete(key)])
        };
        Ok(self.client.txn(txn).await?.succeeded())
    }

    /// Records (`pinned`) or takes back that clients of this host pin entries `names`: their
    /// publisher does not evict an entry while any host's clients pin it. Bound to this
    /// host's lease.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when this host's lease is gone.
    pub async fn pin_for_clients(&self, names: &[(String, String)], pinned: bool) -> Result<()> {
        for (ns, name) in names {
            check_ns(ns)?;
            check_name(name)?;
        }
        for piece in names.chunks(UNITS_PER_TXN) {
            let ops: Vec<Op> = piece
                .iter()
                .map(|(ns, name)| {
                    let key = self.keys.client_pin(ns, name, &self.info.node);
                    if pinned {
                        Op::put(key, "", self.lease)
                    } else {
                        Op::delete(key)
                    }
                })
                .collect();
            let txn = Txn::new()
                .when([self.alive_cmp()])
                .and_then(ops)
                .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
            let r = self.client.txn(txn).await?;
            if !r.succeeded() {
                self.check_alive(&r)?;
            }
        }
        Ok(())
    }

    /// Every entry some host's clients pin, as (namespace, name, node), read at one revision
    /// (returned): watch from the next one.
    pub async fn client_pins(&self) -> Result<(Vec<(String, String, String)>, i64)> {
        let (keys, revision) = self.keys_under(self.keys.client_pins()).await?;
        let pins = keys
            .iter()
            .map(|k| self.keys.split_client_pin(k))
            .collect::<Result<_>>()?;
        Ok((pins, revision))
    }

    /// The keys under `prefix`, read at one revision (returned).
    async fn keys_under(&self, prefix: String) -> Result<(Vec<Vec<u8>>, i64)> {
        let r = self.client.get(prefix, Range::KEYS_UNDER).await?;
        let revision = r.header.map_or(0, |h| h.revision);
        Ok((
            r.kvs.iter().map(|kv| kv.key.as_slice().to_vec()).collect(),
            revision,
        ))
    }

    /// Streams every client pin recorded or taken back from `revision` on (inclusive).
    pub async fn watch_client_pins(&self, revision: i64) -> Result<ClientPinWatch> {
        Ok(ClientPinWatch(
            self.watch_prefix(self.keys.client_pins(), revision).await?,
            self.keys.clone(),
        ))
    }

    /// Reports to host `publisher` the entries of its that this host used since the last
    /// report (the newest last), replacing that report.
    pub async fn report_access(&self, publisher: &str, used: &[(String, String)]) -> Result<()> {
        check_name(publisher)?;
        let key = format!("{}{}", self.keys.access_to(publisher), self.info.node);
        let value = serde_json::to_vec(used).expect("serializable");
        self.client.put(key, value, self.lease).await?;
        Ok(())
    }

    /// Streams the access reports other hosts send this one, from now on.
    pub async fn watch_access(&self) -> Result<AccessWatch> {
        let stream = self
            .client
            .watch(
                self.keys.access_to(&self.info.node),
                Range::PREFIX,
                0,
                false,
            )
            .await?;
        Ok(AccessWatch { stream })
    }

    /// Every pinned entry, read at one revision (returned): watch from the next one.
    pub async fn pins(&self) -> Result<(Vec<(String, String)>, i64)> {
        let (keys, revision) = self.keys_under(self.keys.pins()).await?;
        let pins = keys
            .iter()
            .map(|k| Keys::split_name(&self.keys.pins(), k))
            .collect::<Result<_>>()?;
        Ok((pins, revision))
    }

    /// Streams every pin and unpin from `revision` on (inclusive).
    pub async fn watch_pins(&self, revision: i64) -> Result<PinWatch> {
        Ok(PinWatch(
            self.watch_prefix(self.keys.pins(), revision).await?,
        ))
    }

    /// Sets (or clears) the quota of namespace `ns` for every host: bytes of sealed entries
    /// in it and under it, wherever they were published.
    pub async fn set_quota(&self, ns: &str, bytes: Option<u64>) -> Result<()> {
        check_ns(ns)?;
        let key = self.keys.quota(ns);
        match bytes {
            Some(b) => {
                self.client.put(key, b.to_string(), 0).await?;
            }
            None => {
                self.client.delete(key).await?;
            }
        }
        Ok(())
    }

    /// Every quota, read at one revision (returned): watch from the next one.
    pub async fn quotas(&self) -> Result<(Vec<(String, u64)>, i64)> {
        let prefix = self.keys.quotas();
        let r = self.client.get(prefix.clone(), Range::PREFIX).await?;
        let revision = r.header.map_or(0, |h| h.revision);
        let quotas = r
            .kvs
            .iter()
            .map(|kv| parse_quota(&prefix, kv.key.as_slice(), Some(kv.value.as_slice())))
            .map(|q| q.map(|(ns, b)| (ns, b.unwrap_or(0))))
            .collect::<Result<_>>()?;
        Ok((quotas, revision))
    }

    /// Streams every change of a quota from `revision` on (inclusive).
    pub async fn watch_quotas(&self, revision: i64) -> Result<QuotaWatch> {
        Ok(QuotaWatch(
            self.watch_prefix(self.keys.quotas(), revision).await?,
        ))
    }

    async fn watch_prefix(&self, prefix: String, revision: i64) -> Result<PrefixWatch> {
        let stream = self
            .client
            .watch(prefix.clone(), Range::PREFIX, revision, false)
            .await?;
        Ok(PrefixWatch {
            stream,
            prefix,
            queued: std::collections::VecDeque::new(),
        })
    }

    /// Streams every change to the entries from `revision` on (inclusive); a removal carries
    /// the record removed.
    pub async fn watch_entries(&self, revision: i64) -> Result<EntryWatch> {
        let stream = self
            .client
            .watch(self.keys.entries(), Range::PREFIX, revision, true)
            .await?;
        Ok(EntryWatch {
            stream,
            keys: self.keys.clone(),
            queued: std::collections::VecDeque::new(),
        })
    }

    /// Leaves the cluster: the lease is revoked, so this host's claims go at once.
    pub async fn leave(self) -> Result<()> {
        self.keeper.abort();
        self.client.lease_revoke(self.lease).await?;
        Ok(())
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // Without leave(): the lease runs out after its TTL, as if the host had died.
        self.keeper.abort();
    }
}

/// Keeps the lease alive every third of its TTL; marks the member not live when etcd says
/// the lease is gone, or when no renewal succeeded for a whole TTL (etcd unreachable).
async fn keep_alive(c: Client, lease: i64, ttl: i64, live: Arc<AtomicBool>, node: String) {
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(100));
    let mut last_ok = tokio::time::Instant::now();
    let mut stream = None;
    loop {
        if stream.is_none() {
            stream = tokio::time::timeout(period, c.lease_keep_alive(lease))
                .await
                .ok()
                .and_then(|r| r.ok());
        }
        let mut renewed = false;
        if let Some(keeper) = stream.as_mut() {
            match tokio::time::timeout(period, keeper.renew()).await {
                Ok(Ok(ttl)) if ttl > 0 => renewed = true,
                Ok(Ok(_)) => {
                    tracing::warn!(node, lease, "etcd lease expired");
                    live.store(false, Ordering::Release);
                    return;
                }
                _ => stream = None, // a new stream next time
            }
        }
        if renewed {
            last_ok = tokio::time::Instant::now();
        } else if last_ok.elapsed() >= Duration::from_secs(ttl as u64) {
            tracing::warn!(node, lease, "etcd unreachable for a whole lease TTL");
            live.store(false, Ordering::Release);
            return;
        }
        tokio::time::sleep(period).await;
    }
}

/// The changes to a pool's entries, in revision order.
pub struct EntryWatch {
    stream: WatchStream,
    keys: Keys,
    queued: std::collections::VecDeque<EntryEvent>,
}

/// The next batch of events of a watch; `None` when it ended (etcd went away or compacted
/// past it).
async fn next_events(stream: &mut WatchStream) -> Result<Option<Vec<etcd::Event>>> {
    match stream.message().await? {
        Some(resp) if !resp.canceled => Ok(Some(resp.events)),
        _ => Ok(None),
    }
}

/// Changes to the acknowledgements, from [`Member::watch_acks`].
pub struct AckWatch {
    stream: WatchStream,
}

impl AckWatch {
    /// Waits for the next change; false when the watch ended.
    pub async fn next(&mut self) -> Result<bool> {
        Ok(next_events(&mut self.stream).await?.is_some())
    }
}

/// Access reports, from [`Member::watch_access`].
pub struct AccessWatch {
    stream: WatchStream,
}

impl AccessWatch {
    /// The entries the next reports name (oldest use first); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<Vec<(String, String)>>> {
        loop {
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            let mut used = Vec::new();
            for ev in events {
                if let (EventType::Put, Some(kv)) = (ev.r#type(), ev.kv.as_ref()) {
                    used.extend(decode::<Vec<(String, String)>>(
                        kv.key.as_slice(),
                        kv.value.as_slice(),
                    )?);
                }
            }
            if !used.is_empty() {
                return Ok(Some(used));
            }
        }
    }
}

/// The changes under one prefix: each key, and its new value (None: deleted).
struct PrefixWatch {
    stream: WatchStream,
    prefix: String,
    queued: std::collections::VecDeque<(Vec<u8>, Option<Vec<u8>>)>,
}

impl PrefixWatch {
    async fn next(&mut self) -> Result<Option<(Vec<u8>, Option<Vec<u8>>)>> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Ok(Some(e));
            }
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            for ev in events {
                let Some(kv) = ev.kv.as_ref() else { continue };
                let value = (ev.r#type() == EventType::Put).then(|| kv.value.as_slice().to_vec());
                self.queued.push_back((kv.key.as_slice().to_vec(), value));
            }
        }
    }
}

/// Pins and unpins, from [`Member::watch_pins`].
pub struct PinWatch(PrefixWatch);

impl PinWatch {
    /// The next change, as (namespace, name, pinned); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<(String, String, bool)>> {
        let Some((key, value)) = self.0.next().await? else {
            return Ok(None);
        };
        let (ns, name) = Keys::split_name(&self.0.prefix, &key)?;
        Ok(Some((ns, name, value.is_some())))
    }
}

/// Client pins recorded and taken back, from [`Member::watch_client_pins`].
pub struct ClientPinWatch(PrefixWatch, Keys);

impl ClientPinWatch {
    /// The next change, as (namespace, name, node, pinned); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<(String, String, String, bool)>> {
        let Some((key, value)) = self.0.next().await? else {
            return Ok(None);
        };
        let (ns, name, node) = self.1.split_client_pin(&key)?;
        Ok(Some((ns, name, node, value.is_some())))
    }
}

/// Quota changes, from [`Member::watch_quotas`].
pub struct QuotaWatch(PrefixWatch);

impl QuotaWatch {
    /// The next change, as (namespace, quota; None: cleared); `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<(String, Option<u64>)>> {
        let Some((key, value)) = self.0.next().await? else {
            return Ok(None);
        };
        parse_quota(&self.0.prefix, &key, value.as_deref()).map(Some)
    }
}

/// A quota key's namespace and value.
fn parse_quota(prefix: &str, key: &[u8], value: Option<&[u8]>) -> Result<(String, Option<u64>)> {
    let ns = std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .ok_or_else(|| bad(key, format!("outside {prefix}")))?;
    let bytes = value
        .map(|v| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(key, "not a number of bytes".into()))
        })
        .transpose()?;
    Ok((ns.to_owned(), bytes))
}

impl EntryWatch {
    /// The next change; `None` when the watch ended (etcd went away or compacted past it).
    pub async fn next(&mut self) -> Result<Option<EntryEvent>> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Ok(Some(e));
            }
            let Some(events) = next_events(&mut self.stream).await? else {
                return Ok(None);
            };
            for ev in events {
                let Some(kv) = ev.kv.as_ref() else { continue };
                let (ns, name) = self.keys.split_entry(kv.key.as_slice())?;
                self.queued.push_back(match ev.r#type() {
                    EventType::Put => EntryEvent::Put {
                        ns,
                        name,
                        record: decode(kv.key.as_slice(), kv.value.as_slice())?,
                        revision: kv.create_revision,
                    },
                    EventType::Delete => {
                        let prev = ev.prev_kv.as_ref();
                        EntryEvent::Delete {
                            ns,
                            name,
                            revision: kv.mod_revision,
                            created: prev.map_or(0, |p| p.create_revision),
                            record: prev.and_then(|p| decode(&p.key, &p.value).ok()),
                        }
                    }
                });
            }
        }
    }
}
