//! One host's membership of a pool's cluster: its lease, its claims, its publications,
//! removals, pins, quotas and access reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::etcd::{self, Client, Compare, Op, Range, Txn, TxnResponse};
use crate::keys::*;
use crate::lease::{Renewal, Renewed, boottime_ns, keep_alive, renew, valid_until};
use crate::records::*;
use crate::watch::*;

/// How [`Member::rejoin`] joined again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoined {
    /// etcd still held the lease: this host keeps it, with its node record, claims, holds,
    /// pins and reservations.
    Kept,
    /// On a new lease: whatever the old one held is gone.
    Anew,
}

/// One host's membership of a pool's cluster.
pub struct Member {
    pub(crate) client: Client,
    pub(crate) keys: Keys,
    pub(crate) info: NodeInfo,
    pub(crate) ttl: i64,
    pub(crate) lease: i64,
    live: Arc<AtomicBool>,
    /// Until when this host's lease is sure to be alive ([`Member::validity`]), the revision
    /// of its last beat ([`Member::beaten`]), and the member the last renewal went through.
    renewed: Renewed,
    /// The revision at which this host last wrote its node record: its publications require
    /// it ([`Member::fence_publications`]).
    pub(crate) epoch: AtomicI64,
    keeper: JoinHandle<()>,
    /// Ends the leases of hosts whose renewals stopped ([`crate::detector`]).
    detector: JoinHandle<()>,
    /// A client per etcd member, for the lease's renewals ([`keep_alive`]).
    renewers: Vec<Client>,
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
        let options = etcd::Options {
            patience,
            require_leader: true,
        };
        let client = Client::connect(endpoints, options)?;
        let renewers = Client::each(endpoints, options)?;
        let keys = Keys {
            root: format!("/maru/{pool_uuid}/"),
        };
        let renewed = Renewed::default();
        let (lease, epoch, live, keeper) =
            Self::register(&client, &renewers, &keys, &info, ttl, &renewed).await?;
        let detector = tokio::spawn(crate::detector::watch_beats(
            client.clone(),
            keys.clone(),
            info.node.clone(),
        ));
        Ok(Member {
            detector,
            renewers,
            client,
            keys,
            info,
            ttl,
            lease,
            live,
            renewed,
            epoch: AtomicI64::new(epoch),
            keeper,
        })
    }

    async fn register(
        client: &Client,
        renewers: &[Client],
        keys: &Keys,
        info: &NodeInfo,
        ttl: i64,
        renewed: &Renewed,
    ) -> Result<(i64, i64, Arc<AtomicBool>, JoinHandle<()>)> {
        let c = client.clone();
        let sent = boottime_ns();
        let lease = c.lease_grant(ttl).await?;
        let key = keys.node(&info.node);
        let value = serde_json::to_vec(info).expect("serializable");
        // The first beat and tick, with the node record: the TTL the validity below counts
        // (etcd counts it from when it granted the lease, after it was asked).
        let beat = keys.beat_keys(&info.node);
        let until = valid_until(sent, ttl, ttl);
        let txn = Txn::new().when([Compare::absent(key.clone())]).and_then([
            Op::put(key, value, lease),
            Op::put(beat.beat.clone(), ttl.to_string(), lease),
            Op::put(beat.tick.clone(), until.to_string(), lease),
        ]);
        let r = c.txn(txn).await?;
        if !r.succeeded() {
            let _ = c.lease_revoke(lease).await;
            return Err(Error::NodeTaken(info.node.clone()));
        }
        let epoch = r.revision();
        renewed.valid.store(until, Ordering::Release);
        renewed.beaten.fetch_max(epoch, Ordering::AcqRel);
        let live = Arc::new(AtomicBool::new(true));
        let keeper = tokio::spawn(keep_alive(
            renewers.to_vec(),
            (lease, beat),
            ttl,
            (live.clone(), renewed.clone()),
            info.node.clone(),
        ));
        Ok((lease, epoch, live, keeper))
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.info.node
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl as u64)
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

    /// Until when this host's lease is sure to be alive in etcd, in [`boottime_ns`]: the last
    /// successful renewal's request time plus the TTL, less a third of the TTL (the guard:
    /// what was granted before this instant has that long to be written before another host
    /// can have carved it again); 0 once the lease is known lost, until a rejoin. Other hosts
    /// can claim this host's regions only once the lease is gone: expired by etcd, or revoked
    /// by a host that saw its beats stop ([`crate::detector`]), never before the renewal's
    /// request time plus the TTL either way. The value is shared: it follows the rejoins.
    pub fn validity(&self) -> Arc<AtomicU64> {
        self.renewed.valid.clone()
    }

    /// The revision of this host's last beat (each renewal writes one, with the host's tick:
    /// [`crate::EntryEvent::Tick`]): a watch of the entries that has not delivered it a
    /// renewal's period later lags. The value is shared: it follows the rejoins.
    pub fn beaten(&self) -> Arc<AtomicI64> {
        self.renewed.beaten.clone()
    }

    /// The revision at which this host last wrote its node record (joined, or rejoined):
    /// every entry an earlier run of this node published precedes it.
    pub fn epoch(&self) -> i64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Joins again after the lease was lost here (the keep-alive saw no renewal for a whole
    /// TTL). If etcd still holds the lease (a renewal succeeds: etcd renews every lease when
    /// a new leader takes over, so a host that waited out an election may find its lease
    /// alive), this host keeps it and everything it holds ([`Rejoined::Kept`]); otherwise a
    /// new lease, the node record recreated ([`Rejoined::Anew`]): what the old lease held
    /// (claims) is gone, the caller re-claims what it needs.
    pub async fn rejoin(&mut self) -> Result<Rejoined> {
        self.keeper.abort();
        let (renewal, at) = self.renew_lost().await;
        if let Renewal::Until(kept, revision) = renewal {
            self.live = Arc::new(AtomicBool::new(true));
            self.renewed.renewed(kept, revision, at);
            // Publications sent before the loss must not land: the node record is written
            // again (which also proves the lease owns it).
            if self.fence_publications().await.is_ok() {
                self.keeper = tokio::spawn(keep_alive(
                    self.renewers.clone(),
                    (self.lease, self.keys.beat_keys(&self.info.node)),
                    self.ttl,
                    (self.live.clone(), self.renewed.clone()),
                    self.info.node.clone(),
                ));
                return Ok(Rejoined::Kept);
            }
            self.renewed.valid.store(0, Ordering::Release);
            self.live.store(false, Ordering::Release);
        }
        if renewal == Renewal::Gone {
            // Another host may have found this one's beats stopped and not yet revoked the
            // lease: its node record would keep the name taken.
            let _ = self.client.lease_revoke(self.lease).await;
        }
        let (lease, epoch, live, keeper) = Self::register(
            &self.client,
            &self.renewers,
            &self.keys,
            &self.info,
            self.ttl,
            &self.renewed,
        )
        .await?;
        self.lease = lease;
        self.epoch.store(epoch, Ordering::Release);
        self.live = live;
        self.keeper = keeper;
        Ok(Rejoined::Anew)
    }

    /// One renewal of the lease this host deemed lost, asked of each member in turn (a third
    /// of the TTL each) until one answers: until when the lease is then sure to be alive, if
    /// etcd renewed it; [`Renewal::Failed`] if none answered. With the member that answered.
    async fn renew_lost(&self) -> (Renewal, usize) {
        let beat = self.keys.beat_keys(&self.info.node);
        for (at, m) in self.renewers.iter().enumerate() {
            match renew(m, &mut None, (self.lease, &beat), self.ttl).await {
                Renewal::Failed => {}
                answered => return (answered, at),
            }
        }
        (Renewal::Failed, 0)
    }

    /// The comparison a publication makes: this host's node record is as it last wrote it
    /// (so its lease owns it, and no [`Member::fence_publications`] came since).
    /// Also the epoch it compares.
    pub(crate) fn publish_cmp(&self) -> (Compare, i64) {
        let epoch = self.epoch.load(Ordering::Acquire);
        (
            Compare::modified(self.keys.node(&self.info.node), epoch),
            epoch,
        )
    }

    /// Makes every publication of this host still on its way to etcd fail, should it arrive
    /// (one whose answer was lost can reach etcd much later: the network queued it): writes
    /// the node record again, which the publications compare. Those sent from now on compare
    /// the new write.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when this host's lease is gone (then none of its publications can
    /// land anyway); [`Error::Etcd`].
    pub async fn fence_publications(&self) -> Result<()> {
        let key = self.keys.node(&self.info.node);
        let value = serde_json::to_vec(&self.info).expect("serializable");
        let txn = Txn::new()
            .when([self.alive_cmp()])
            .and_then([Op::put(key, value, self.lease)]);
        let r = self.client.txn(txn).await?;
        if !r.succeeded() {
            return Err(Error::LeaseLost(self.info.node.clone()));
        }
        self.epoch.fetch_max(r.revision(), Ordering::AcqRel);
        Ok(())
    }

    /// The comparison that holds only while this host's lease owns its node record.
    pub(crate) fn alive_cmp(&self) -> Compare {
        Compare::lease_is(self.keys.node(&self.info.node), self.lease)
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

    pub(crate) async fn publish_as(
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
        let (alive, epoch) = self.publish_cmp();
        let mut when = vec![
            alive,
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
        if self.epoch_moved(&r, epoch) {
            // Publications were fenced while this one was on its way: it never landed.
            return Box::pin(self.publish_as(ns, name, record, reserved)).await;
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
            return Ok(Some(Published::Exists {
                record: decode(kv.key.as_slice(), kv.value.as_slice())?,
                created: kv.create_revision,
            }));
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
        // As a publication, it compares the fence: one whose answer was lost, given back
        // after a fence (`fence_publications`), cannot land after and keep the name.
        let (current, epoch) = self.publish_cmp();
        let txn = Txn::new()
            .when([
                current,
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
        if self.epoch_moved(&r, epoch) {
            return Box::pin(self.reserve(ns, name)).await;
        }
        self.check_alive(&r)?;
        self.name_taken(&r)
    }

    /// Gives back a reservation of this host's (another's is left alone).
    pub async fn unreserve(&self, ns: &str, name: &str) -> Result<()> {
        self.delete_if_mine(self.keys.reservation(ns, name)).await
    }

    /// Whether a publication's transaction that compared `epoch` failed because publications
    /// were fenced since ([`Member::fence_publications`]): the node record (read first in its
    /// failure branch) is this lease's, and written after `epoch`. The write is then the
    /// epoch to compare from now on, even when it came from a fence whose answer was lost
    /// (it landed all the same): without that, every publication and claim would fail on it
    /// and be tried again, for ever (seed 211: two marud overflowed their stacks so).
    pub(crate) fn epoch_moved(&self, r: &TxnResponse, epoch: i64) -> bool {
        let Some(kv) = r.range(0).and_then(|g| g.kvs.first()) else {
            return false;
        };
        if kv.lease != self.lease || kv.mod_revision <= epoch {
            return false;
        }
        self.epoch.fetch_max(kv.mod_revision, Ordering::AcqRel);
        true
    }

    /// From a failed transaction's first read (this node's record): LeaseLost unless the
    /// record is there under this host's lease.
    pub(crate) fn check_alive(&self, r: &TxnResponse) -> Result<()> {
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

    /// Whether entry `ns/name` holds `record` now (a publication whose outcome was unknown:
    /// it made it if so): the revision that created it, or None.
    pub async fn published_as(
        &self,
        ns: &str,
        name: &str,
        record: &EntryRecord,
    ) -> Result<Option<i64>> {
        check_ns(ns)?;
        check_name(name)?;
        let r = self
            .client
            .get(self.keys.entry(ns, name), Range::KEY)
            .await?;
        Ok(r.kvs
            .first()
            .filter(|kv| decode::<EntryRecord>(&kv.key, &kv.value).is_ok_and(|got| got == *record))
            .map(|kv| kv.create_revision))
    }

    /// Removes entry `ns/name` (and its pin), whichever is there, at the revision returned:
    /// [`Member::remove_many`] of one.
    pub async fn remove(&self, ns: &str, name: &str) -> Result<Removed> {
        let one = Removing {
            ns,
            name,
            entry: None,
        };
        self.remove_many(&[one]).await.pop().expect("one outcome")
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
            loop {
                // As a publication: one whose answer was lost cannot land after a fence
                // (`fence_publications`), so a hold let go after it cannot come back.
                let (current, epoch) = self.publish_cmp();
                let txn = Txn::new()
                    .when([current])
                    .and_then(
                        piece
                            .iter()
                            .map(|(k, v)| Op::put(k.clone(), v.clone(), self.lease))
                            .collect::<Vec<_>>(),
                    )
                    .or_else([Op::get(self.keys.node(&self.info.node), Range::KEY)]);
                let r = self.client.txn(txn).await?;
                if r.succeeded() || !self.epoch_moved(&r, epoch) {
                    if !r.succeeded() {
                        self.check_alive(&r)?;
                    }
                    break;
                }
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
        let acked = self.keys.acks_by_node(&acks.kvs);
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

    pub(crate) async fn delete_keys(&self, keys: &[String]) -> Result<()> {
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

    /// Every entry, and the removals not yet acknowledged by every live host, read at one
    /// revision.
    pub async fn snapshot(&self) -> Result<Snapshot> {
        let sent = boottime_ns();
        let read = Txn::new().and_then([
            Op::get(self.keys.entries(), Range::PREFIX),
            Op::get(self.keys.tombstones(), Range::KEYS_UNDER),
        ]);
        let r = self.client.txn(read).await?;
        let (Some(entries), Some(stones)) = (r.range(0), r.range(1)) else {
            return Err(bad(
                self.keys.entries().as_bytes(),
                "an unexpected reply".into(),
            ));
        };
        let mut snap = Snapshot {
            entries: Vec::with_capacity(entries.kvs.len()),
            revision: r.revision(),
            removals: Default::default(),
            fresh_until: valid_until(sent, self.ttl, self.ttl),
        };
        for kv in &entries.kvs {
            let (ns, name) = self.keys.split_entry(kv.key.as_slice())?;
            snap.entries.push(Listed {
                ns,
                name,
                record: decode(kv.key.as_slice(), kv.value.as_slice())?,
                revision: kv.create_revision,
            });
        }
        for kv in &stones.kvs {
            if let Some(offset) = self.keys.tombstone_offset(kv.key.as_slice()) {
                let newest = snap.removals.entry(offset).or_default();
                *newest = (*newest).max(kv.mod_revision);
            }
        }
        Ok(snap)
    }

    /// Pins entry `ns/name` for every host (its publisher never evicts it), or unpins it.
    /// The revision of the change; None (nothing recorded) when pinning an entry that does
    /// not exist.
    pub async fn pin(&self, ns: &str, name: &str, pinned: bool) -> Result<Option<i64>> {
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
        let r = self.client.txn(txn).await?;
        Ok(r.succeeded().then(|| r.revision()))
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
    /// in it and under it, wherever they were published. Returns the revision of the change
    /// (clearing a quota that was not set changes nothing: the revision etcd is at).
    pub async fn set_quota(&self, ns: &str, bytes: Option<u64>) -> Result<i64> {
        check_ns(ns)?;
        let key = self.keys.quota(ns);
        let op = match bytes {
            Some(b) => Op::put(key, b.to_string(), 0),
            None => Op::delete(key),
        };
        Ok(self.client.txn(Txn::new().and_then([op])).await?.revision())
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

    /// Streams every change to the entries from `revision` on (inclusive), and every host's
    /// ticks among them; a removal carries the record removed.
    ///
    /// The watch goes to the etcd member the lease's last renewal went through (in touch
    /// with etcd's leader then), not to whichever the balancer picks: a watch on a member
    /// cut off from the others delivers nothing, and no error either until HTTP/2 keep-alive
    /// finds the connection dead (twice the patience), so a watch started again because it
    /// lagged would otherwise often go back to the same member.
    pub async fn watch_entries(&self, revision: i64) -> Result<EntryWatch> {
        let through = self.renewed.through.load(Ordering::Acquire);
        let stream = self.renewers[through]
            .watch(self.keys.entry_watch(), Range::PREFIX, revision, true)
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
        self.detector.abort();
        self.client.lease_revoke(self.lease).await?;
        Ok(())
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // Without leave(): the lease runs out after its TTL, as if the host had died.
        self.keeper.abort();
        self.detector.abort();
    }
}
