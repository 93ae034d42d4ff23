//! Cluster mode: several hosts, each with its own marud, sharing one raw pool, with the
//! metadata in etcd (`maru-cluster`).
//!
//! - [`EtcdAuthority`] is the store's metadata authority: names stay write-once across hosts
//!   (a publication is an etcd transaction, see `maru_cluster::Member::publish`), and every
//!   region this host carves of the shared pool is claimed in etcd under its lease.
//! - [`applier::start_applier`] keeps the store fed with what the other hosts publish and remove: a
//!   snapshot of the entries, then a watch from the next revision; each entry of another
//!   host is filed as a remote entry (served here, never carved, freed or evicted here).
//! - A host whose lease was lost (cut off from etcd past its TTL) publishes and claims
//!   nothing until it has rejoined; it rejoins by itself and claims its regions again.
//!
//! The store asks for a client's publications with its lock released, and those waiting at
//! the same moment go to etcd together (`group`); the mount's publications, removals, pins
//! and evictions' waits are still asked under the store's lock.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use maru::{Error, Result};
use maru_cluster::{EntryAt, Member, NodeInfo, Published};
use parking_lot::Mutex;
use tokio::sync::RwLock;

use self::changes::Changing;
use self::known::Known;
use crate::store::SharedId;
use crate::store::authority::{
    Authority, Claim, LocalAuthority, Placed, Publishing, Recording, Withdrawn,
};

pub mod applier;
mod blocking;
mod changes;
mod client_pins;
mod group;
mod known;
mod membership;
mod orphans;
mod publishing;
mod readers;
mod regions;
mod releasing;
mod reservations;
#[cfg(feature = "seams")]
mod seams;
mod view;

use client_pins::ClientPins;
use readers::{Hold, Readers};

#[cfg(feature = "seams")]
pub use client_pins::PinGate;
#[cfg(feature = "seams")]
pub use group::RemovalGate;
#[cfg(feature = "seams")]
pub use releasing::ReleaseGate;

/// An entry's name: (namespace, key).
type Name = (String, String);

/// `--cluster`, `--node`, `--cluster-ttl`, `--cluster-orphans-after`.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// etcd endpoints (`http://HOST:2379`).
    pub endpoints: Vec<String>,
    /// This host's name in the cluster.
    pub node: String,
    /// The lease's time to live: how long a dead or cut-off host keeps its claims.
    pub ttl: Duration,
    /// How long a publisher stays gone before the other hosts may evict its entries.
    pub orphans_after: Duration,
}

/// The cluster's metadata could not do what the store asked: an I/O error for the store's
/// callers, its cause kept as its source (an etcd error, a lost lease, ...).
#[derive(Debug, thiserror::Error)]
#[error("cluster: {0}")]
struct Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>);

fn unavailable(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Io(std::io::Error::other(Unavailable(cause.into())))
}

/// The seam before a claim of a fresh region goes to etcd: called with the region's offset
/// (tests; feature `seams`).
#[cfg(feature = "seams")]
pub type ClaimGate = Box<dyn Fn(u64) + Send + Sync>;

/// The metadata authority shared by the hosts of a cluster.
pub struct EtcdAuthority {
    local: LocalAuthority,
    rt: tokio::runtime::Runtime,
    member: Arc<RwLock<Member>>,
    node: String,
    /// The shared pool's device UUID.
    pool: String,
    /// Each publication of this host, by name: its etcd revision (a removal the watch reports
    /// from before it is an older entry's) and its extent.
    published: Mutex<HashMap<(String, String), EntryAt>>,
    /// Names this host is changing in the shared pool, with the other hosts' changes of each
    /// held back meanwhile.
    changing: Changing,
    /// Each entry of another host this host serves: its publisher, and the etcd revision
    /// that created it.
    remote: Mutex<HashMap<(String, String), (String, i64)>>,
    /// What clients of this host use of other hosts' entries, and the holds that follow.
    readers: Mutex<Readers>,
    next_tag: AtomicU64,
    /// The revision of entries up to which the applier has applied every removal: what the
    /// acknowledger writes to etcd next (after the holds those removals took).
    applied: AtomicI64,
    /// Wakes the acknowledger.
    ack_kick: Arc<tokio::sync::Notify>,
    /// Bumped at every change to the other hosts' acknowledgements (etcd's watch), and at each
    /// removal of this host's: what waits for removals to settle looks again.
    acks_seen: tokio::sync::watch::Sender<u64>,
    /// This host's entries that another host removed, whose removal is held back here for a
    /// change of the name this host is making: refused to new readers meanwhile
    /// ([`Authority::own_removed`]).
    own_gone: Mutex<HashSet<SharedId>>,
    /// Extents (offsets) this host removed, with the removal's revision: freed once every
    /// other live host acknowledged that revision and none holds the extent.
    held: Mutex<HashMap<u64, i64>>,
    /// An eviction's wait for the acknowledgements ran out (a host slow or cut off): the next
    /// ones do not wait, until the background settler has seen every removal acknowledged.
    settle_stalled: AtomicBool,
    /// This host's removals may have left tombstones in etcd that are not swept yet
    /// (`maru_cluster::Member::sweep`).
    tombstones: AtomicBool,
    /// The newest removal here of another host's entry (a delete, or an eviction of an
    /// orphan) whose tombstones may not be swept yet: they keep the extent's units from a
    /// fresh claim, so an eviction waits for them as for its own extents (`settle`).
    others_removed: Mutex<Option<i64>>,
    /// Since when the publishers of the entries served here have been gone.
    orphans: orphans::Orphans,
    /// Names this host reserved in etcd for writers through its mount.
    reserved: Mutex<HashSet<Name>>,
    /// Names whose reservation this host is giving back in etcd.
    reservations: Arc<reservations::Reservations>,
    /// The entries pinned in the cluster (this host's pins, and every host's from etcd's
    /// watch), each with the revision of its last change.
    pins: Mutex<Known<Name, ()>>,
    /// Other hosts' entries that clients of this host pin (recorded in etcd under its lease).
    client_pins: ClientPins,
    /// The entries clients pin, and on which hosts (from etcd's watch).
    client_pinned: Mutex<HashMap<Name, HashSet<String>>>,
    /// The quotas of the cluster (this host's, and every host's from etcd's watch), each
    /// with the revision of its last change.
    quotas: Mutex<Known<String, u64>>,
    /// Other hosts' entries used here since the last report, by publisher: name -> order.
    used: Mutex<HashMap<String, HashMap<Name, u64>>>,
    uses: AtomicU64,
    /// Uses of this host's entries other hosts reported.
    uses_reported: AtomicU64,
    /// Regions (offsets) of this host's where nothing more is placed, and why.
    lost: Mutex<HashMap<u64, Lost>>,
    endpoints: Vec<String>,
    /// The hosts and what each claims, refreshed every second (for stats).
    hosts: Mutex<Vec<maru::proto::HostInfo>>,
    /// Publications on their way to etcd, together.
    group: group::GroupCommit,
    /// Until when this host's lease is sure to be alive (`Member::validity`).
    valid: Arc<AtomicU64>,
    /// How fresh and how far this host's view of the entries is.
    view: Arc<view::View>,
    /// Rejoins done so far; and the count at which the applier last began a read of every
    /// entry that it applied (after a rejoin, removals made while this host was cut off
    /// reach it that way: the read must begin after the rejoin).
    rejoins: tokio::sync::watch::Sender<u64>,
    caught_up: AtomicU64,
    /// A rejoin is under way: its regions are being claimed again.
    rejoining: AtomicBool,
    /// Regions given back here whose claims etcd has not deleted yet: tried in the
    /// background until it does; a claim over one of them finishes it first.
    releasing: Arc<releasing::Releasing>,
    /// The seam before a claim of a fresh region goes to etcd (tests; feature `seams`).
    #[cfg(feature = "seams")]
    claim_gate: parking_lot::RwLock<Option<ClaimGate>>,
}

impl EtcdAuthority {
    /// Joins the cluster of pool `pool_uuid`. A node name still held (this host restarted
    /// within its old lease's TTL) is waited for, up to the TTL and a little more.
    pub fn join(s: &ClusterSettings, pool_uuid: &str) -> anyhow::Result<Arc<Self>> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("maru-cluster")
            .enable_all()
            .build()?;
        let info = NodeInfo {
            node: s.node.clone(),
            address: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
            pid: std::process::id(),
        };
        let (eps, pool, ttl) = (s.endpoints.clone(), pool_uuid.to_owned(), s.ttl);
        let member = rt.block_on(async move {
            let start = tokio::time::Instant::now();
            loop {
                let now = tokio::time::Instant::now();
                match Member::join(&eps, &pool, info.clone(), ttl).await {
                    Err(maru_cluster::Error::NodeTaken(n))
                        if now < start + ttl + Duration::from_secs(3) =>
                    {
                        tracing::info!(node = %n, "node name still held (an earlier run's lease); waiting");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    // etcd without a leader (an election), or not answering: for 30 s.
                    Err(maru_cluster::Error::Etcd(e)) if now < start + Duration::from_secs(30) => {
                        tracing::warn!("joining the cluster: etcd: {e}; trying again");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    r => return r,
                }
            }
        })?;
        tracing::info!(node = %s.node, pool = %pool_uuid, endpoints = ?s.endpoints, lease = member.lease(), "joined the cluster");
        let (valid, beaten) = (member.validity(), member.beaten());
        let member = Arc::new(RwLock::new(member));
        let group = group::GroupCommit::start(&rt, member.clone());
        let client_pins = ClientPins::start(rt.handle(), member.clone());
        let me = Arc::new(EtcdAuthority {
            local: LocalAuthority::default(),
            rt,
            member,
            node: s.node.clone(),
            pool: pool_uuid.to_owned(),
            published: Mutex::new(HashMap::new()),
            changing: Changing::default(),
            remote: Mutex::new(HashMap::new()),
            readers: Mutex::new(Readers::default()),
            next_tag: AtomicU64::new(1),
            applied: AtomicI64::new(0),
            ack_kick: Arc::new(tokio::sync::Notify::new()),
            acks_seen: tokio::sync::watch::Sender::new(0),
            own_gone: Mutex::new(HashSet::new()),
            held: Mutex::new(HashMap::new()),
            settle_stalled: AtomicBool::new(false),
            tombstones: AtomicBool::new(false),
            others_removed: Mutex::new(None),
            orphans: orphans::Orphans::new(s.orphans_after),
            reserved: Mutex::new(HashSet::new()),
            reservations: Default::default(),
            pins: Mutex::new(Known::default()),
            client_pins,
            client_pinned: Mutex::new(HashMap::new()),
            quotas: Mutex::new(Known::default()),
            used: Mutex::new(HashMap::new()),
            uses: AtomicU64::new(0),
            uses_reported: AtomicU64::new(0),
            lost: Mutex::new(HashMap::new()),
            endpoints: s.endpoints.clone(),
            hosts: Mutex::new(Vec::new()),
            group,
            valid,
            view: Arc::new(view::View::new(&s.node, beaten)),
            // The start counts as a rejoin: what this host recovered from its own log may
            // have been removed elsewhere while it was down, so it serves nothing of the
            // shared pool until its first read of every entry is applied.
            rejoins: tokio::sync::watch::Sender::new(1),
            caught_up: AtomicU64::new(0),
            rejoining: AtomicBool::new(false),
            releasing: Arc::default(),
            #[cfg(feature = "seams")]
            claim_gate: Default::default(),
        });
        me.start_membership();
        me.rt.spawn(acknowledge(Arc::downgrade(&me)));
        me.rt.spawn(watch_acks(Arc::downgrade(&me)));
        Ok(me)
    }

    /// Runs `f` on the cluster runtime and waits for it ([`wait_on`]).
    fn run<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> T {
        blocking::wait_on(self.rt.handle(), f)
    }

    /// Installs the seam before a client pin's record goes to etcd (tests).
    #[cfg(feature = "seams")]
    pub fn set_pin_gate(&self, gate: Option<PinGate>) {
        self.client_pins.set_gate(gate);
    }

    fn member(&self) -> Arc<RwLock<Member>> {
        self.member.clone()
    }

    /// The applier applied every change to the entries up to `revision`: acknowledged (in
    /// the background, after the holds those changes took) for the publishers of removed
    /// entries, which free an extent only once every live host has.
    fn applied(&self, revision: i64) {
        if self.applied.fetch_max(revision, Ordering::AcqRel) < revision {
            self.ack_kick.notify_one();
        }
    }

    /// A removal of entry `id` (its extent `len` bytes long) reached this host, from etcd's
    /// watch or a read of every entry: new readers here are refused it until the store has
    /// applied it, and if clients here map it this host holds its extent. Both before the
    /// removal is acknowledged, and before the store applies it (which may wait for the
    /// store's lock, or for a change of the name here to settle: an acknowledgement never
    /// does).
    fn on_removal(&self, id: SharedId, len: u64) {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        if self.readers.lock().removal(id, len, tag) {
            self.ack_kick.notify_one();
        }
    }

    /// The store applied the removal of entry `id` (it serves the entry no more).
    fn removal_applied(&self, id: SharedId) {
        self.readers.lock().removed.remove(&id);
    }

    /// Of the removals still refused to new readers, keeps those of entries the store still
    /// has (`served`): a removal passed by for a later read of every entry, whose entry went
    /// another way meanwhile, leaves no refusal behind.
    fn refusals_only_for(&self, served: &HashSet<SharedId>) {
        self.readers.lock().removed.retain(|c| served.contains(c));
    }

    /// Deletes hold `h`'s record in etcd, in the background, and again every half second while
    /// etcd fails it (left, it would keep the extent from its publisher as long as this host
    /// lives); not once the lease it was recorded under is gone (it went with it). A hold
    /// whose recording went unanswered (timed out: it may have landed, or land later, the
    /// network having queued it) is deleted too, after a fence of this host's publications
    /// (`Member::fence_publications`), which the recordings compare: none lands after.
    /// The tombstones of this host's removals of other hosts' entries, up to the newest
    /// known when `through` was read, are swept: nothing to wait for, unless a newer one
    /// came since.
    fn swept_others(&self, through: Option<i64>) {
        let mut r = self.others_removed.lock();
        if *r == through {
            *r = None;
        }
    }

    fn forget_hold(&self, h: Hold) {
        if !h.recorded && !h.unanswered {
            return;
        }
        let m = self.member();
        self.rt.spawn(async move {
            let lease = m.read().await.lease();
            for attempt in 0u32.. {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                let m = m.read().await;
                if m.lease() != lease {
                    return;
                }
                let fenced = if h.unanswered {
                    m.fence_publications().await
                } else {
                    Ok(())
                };
                match fenced.and(m.unhold(h.offset, h.len, h.tag).await) {
                    Ok(()) => return,
                    Err(e) if attempt == 0 => tracing::warn!(
                        offset = h.offset,
                        "letting go of a hold: {e}; trying again until etcd takes it"
                    ),
                    Err(_) => {}
                }
            }
        });
    }
}

/// Of this host's removed extents `pending` (offset, revision of the removal), those free to
/// carve again: every other live host acknowledged the removal (`acked` is the least
/// acknowledgement, None with no other live host) and none holds the extent.
async fn free_of(
    m: &Member,
    pending: &[(u64, i64)],
    acked: Option<i64>,
) -> maru_cluster::Result<Vec<(u64, i64)>> {
    let seen: Vec<(u64, i64)> = pending
        .iter()
        .filter(|(_, r)| acked.is_none_or(|a| a >= *r))
        .copied()
        .collect();
    let offsets: Vec<u64> = seen.iter().map(|(o, _)| *o).collect();
    let held = m.held(&offsets).await?;
    Ok(seen
        .into_iter()
        .filter(|(o, _)| !held.contains(o))
        .collect())
}

/// Takes out of `held` the extents of `free` (offset, removal's revision) still waiting for
/// that same removal, and returns their offsets: one freed meanwhile (by a `settle`, or the
/// round that raced it), and maybe carved, published and removed again since, waits for its
/// new removal's acknowledgements.
fn unhold(held: &Mutex<HashMap<u64, i64>>, free: Vec<(u64, i64)>) -> Vec<u64> {
    let mut held = held.lock();
    free.into_iter()
        .filter(|(o, r)| held.get(o) == Some(r) && held.remove(o).is_some())
        .map(|(o, _)| o)
        .collect()
}

/// Why a region of this host's is marked lost (nothing more placed, nothing published there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// Not claimed again after a rejoin: another host took it while this one was cut off.
    Taken,
    /// Claimed again after a rejoin, but another host's entry lives there (that host took,
    /// wrote and lost it meanwhile), or the claim again failed (whether it landed is not
    /// known): the claim in etcd, if any, is this host's, given back when freed.
    Occupied,
}

/// How long an eviction waits for every live host's acknowledgement of its removals before
/// it leaves their extents to be freed in the background.
const SETTLE_WAIT: Duration = Duration::from_millis(100);

/// How long an eviction waits for the tombstones of other hosts' entries it removed (an
/// orphan's) to be swept ([`EtcdAuthority::settle`]).
const SWEEP_WAIT: Duration = Duration::from_secs(1);

/// Writes this host's acknowledgements: whenever the applier has applied further removals
/// (or this host rejoined, or a hold is not recorded yet), records the new holds and then the
/// revision applied, in that order (`Member::acknowledge`). Retries every 200 ms while etcd
/// does not answer.
async fn acknowledge(me: std::sync::Weak<EtcdAuthority>) {
    let Some(kick) = me.upgrade().map(|a| a.ack_kick.clone()) else {
        return;
    };
    let mut acked = (0i64, 0i64); // (lease, revision)
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), kick.notified()).await;
        let Some(a) = me.upgrade() else { return };
        let want = a.applied.load(Ordering::Acquire);
        let todo: Vec<(SharedId, Hold)> = a
            .readers
            .lock()
            .holds
            .iter()
            .filter(|(_, h)| !h.recorded)
            .map(|(i, h)| (*i, h.clone()))
            .collect();
        let m = a.member.read().await;
        if want == 0 || ((m.lease(), want) == acked && todo.is_empty()) {
            continue;
        }
        let extents: Vec<(u64, u64, u64)> =
            todo.iter().map(|(_, h)| (h.offset, h.len, h.tag)).collect();
        if let Err(e) = m.acknowledge(want, &extents).await {
            tracing::debug!(revision = want, "acknowledging removals: {e}");
            if !e.never_sent() {
                let mut r = a.readers.lock();
                for (id, h) in &todo {
                    if let Some(x) = r.holds.get_mut(id)
                        && x.tag == h.tag
                    {
                        x.unanswered = true;
                    } else {
                        // Let go of meanwhile, and its recording may land: take it back.
                        drop(r);
                        a.forget_hold(Hold {
                            unanswered: true,
                            ..h.clone()
                        });
                        r = a.readers.lock();
                    }
                }
            }
            continue;
        }
        acked = (m.lease(), want);
        drop(m);
        for (id, h) in todo {
            let mut r = a.readers.lock();
            match r.holds.get_mut(&id) {
                Some(x) if x.tag == h.tag => x.recorded = true,
                _ => {
                    // Let go of meanwhile: take the record back.
                    drop(r);
                    a.forget_hold(Hold {
                        recorded: true,
                        ..h
                    });
                }
            }
        }
    }
}

/// Wakes removals waiting for acknowledgements (`EtcdAuthority::settle`) whenever another
/// host acknowledges or leaves.
async fn watch_acks(me: std::sync::Weak<EtcdAuthority>) {
    loop {
        let Some(a) = me.upgrade() else { return };
        let (m, seen) = (a.member(), a.acks_seen.clone());
        drop(a);
        let w = m.read().await.watch_acks().await;
        if let Ok(mut w) = w {
            while let Ok(true) = w.next().await {
                seen.send_modify(|n| *n += 1);
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

impl Authority for EtcdAuthority {
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        self.local.reserve(ns, key, id)
    }

    fn reserve_everywhere(&self, ns: &str, key: &str, id: u64, pool: Option<&str>) -> Result<()> {
        self.local.reserve(ns, key, id)?;
        if pool != Some(self.pool.as_str()) {
            return Ok(());
        }
        self.reserve_shared(ns, key, id)
    }

    fn publish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<()> {
        let p = Publishing {
            ns,
            key,
            id,
            at: *at,
        };
        self.publish_group(&[p])
            .pop()
            .expect("one outcome per publication")
    }

    fn publish_many(&self, items: &[Publishing<'_>]) -> Vec<Result<()>> {
        self.publish_group(items)
    }

    fn release(&self, ns: &str, key: &str, id: u64) {
        let reserved = self.local.holder(ns, key) == Some(Claim::Reserved(id));
        if reserved {
            self.drop_reservation(ns, key);
        }
        let published = self.local.holder(ns, key) == Some(Claim::Published(id));
        let name = (ns.to_owned(), key.to_owned());
        if published && self.published.lock().contains_key(&name) {
            if let Err(e) = self.remove_own(ns, key) {
                tracing::error!(ns, key, "removing the entry from the cluster: {e}");
            }
            self.published.lock().remove(&name);
        }
        self.local.release(ns, key, id);
        if published || reserved {
            self.changing.settle(ns, key);
        }
    }

    fn withdrawing(&self, ns: &str, key: &str) {
        self.changing.begin(ns, key);
    }

    fn settled(&self, ns: &str, key: &str) {
        self.changing.settle(ns, key);
    }

    fn withdraw(&self, items: &[Publishing<'_>]) -> Vec<Result<Option<Withdrawn>>> {
        self.withdraw_group(items)
    }

    fn unpublish(
        &self,
        ns: &str,
        key: &str,
        id: u64,
        at: &Placed<'_>,
        withdrawn: Option<Withdrawn>,
    ) -> Result<bool> {
        let name = (ns.to_owned(), key.to_owned());
        if at.pool != Some(self.pool.as_str())
            || self.local.holder(ns, key) != Some(Claim::Published(id))
        {
            self.local.release(ns, key, id);
            return Ok(false);
        }
        let revision = match withdrawn {
            Some(w) => w.revision,
            None => self.remove_own(ns, key)?.revision,
        };
        // Only this host's own extents are its to free (another host's: its publisher's).
        // Its own publication of the name at this place says so, whatever `remote` holds: a
        // record of another host's entry of the name may be left there (filed late, by a
        // watch that lagged, over this host's entry), and taken for the truth, this host's
        // extent was freed at once, before the other hosts acknowledged the removal or let
        // go of their mappings of it.
        let mine = self
            .published
            .lock()
            .remove(&name)
            .is_some_and(|p| p.offset == at.offset());
        let elsewhere = self.remote.lock().remove(&name).is_some();
        let own = mine || !elsewhere;
        self.local.release(ns, key, id);
        if !own {
            let mut r = self.others_removed.lock();
            *r = Some(r.map_or(revision, |r| r.max(revision)));
        }
        if own {
            // Freed once every other live host acknowledged the removal and none holds it
            // (`settle`, or in the background, which looks at once: with no other live host
            // that is all it takes).
            self.held.lock().insert(at.offset(), revision);
            self.acks_seen.send_modify(|n| *n += 1);
        }
        Ok(own)
    }

    fn settle(&self) -> Vec<(String, u64)> {
        let pending: Vec<(u64, i64)> = self.held.lock().iter().map(|(o, r)| (*o, *r)).collect();
        let others = *self.others_removed.lock();
        let Some(newest) = pending.iter().map(|(_, r)| *r).chain(others).max() else {
            return Vec::new();
        };
        crate::store::assert_unlocked("an eviction's wait for the other hosts");
        if self.settle_stalled.load(Ordering::Acquire) {
            return Vec::new();
        }
        let (m, mut seen) = (self.member(), self.acks_seen.subscribe());
        // The units of other hosts' entries removed here come back to this host only through
        // a fresh claim, which their tombstones refuse: longer, so that the eviction that
        // made room for a grant is not answered "full" for want of a sweep.
        let wait = if others.is_some() {
            SWEEP_WAIT
        } else {
            SETTLE_WAIT
        };
        let deadline = tokio::time::Instant::now() + wait;
        let (free, complete, swept) = self.run(async move {
            loop {
                seen.borrow_and_update();
                let Ok(acked) = m.read().await.acknowledged().await else {
                    return (Vec::new(), false, false);
                };
                let complete = acked.is_none_or(|a| a >= newest);
                let late = tokio::time::Instant::now() >= deadline;
                if complete || late {
                    let m = m.read().await;
                    // Removals here of other hosts' entries free no extent of this host's,
                    // but their tombstones keep the units from a fresh claim: swept once every
                    // live host acknowledged them (this host's own acknowledgement may trail
                    // the others': looked at again, until the deadline).
                    let swept = match others {
                        None => true,
                        Some(r) => complete && m.sweep_through(r).await.unwrap_or(false),
                    };
                    if swept || late {
                        let free = free_of(&m, &pending, acked).await;
                        return (free.unwrap_or_default(), complete, swept);
                    }
                }
                let _ = tokio::time::timeout_at(deadline, seen.changed()).await;
            }
        });
        if !complete {
            tracing::info!(
                revision = newest,
                "a removal is not acknowledged by every host yet: its extent is freed later"
            );
            self.settle_stalled.store(true, Ordering::Release);
        }
        if swept {
            self.swept_others(others);
        }
        unhold(&self.held, free)
            .into_iter()
            .map(|o| (self.pool.clone(), o))
            .collect()
    }

    fn orphaned(&self, ns: &str, key: &str) -> bool {
        if !self.orphans.any(std::time::Instant::now()) {
            return false;
        }
        let remote = self.remote.lock();
        remote
            .get(&(ns.to_owned(), key.to_owned()))
            .is_some_and(|(publisher, _)| {
                self.orphans.orphaned(publisher, std::time::Instant::now())
            })
    }

    fn held_elsewhere(&self, pool: &str, offset: u64) -> bool {
        pool == self.pool && self.held.lock().contains_key(&offset)
    }

    fn use_remote(&self, id: SharedId) -> bool {
        self.readers.lock().start(id)
    }

    fn own_removed(&self, ns: &str, key: &str) -> bool {
        let gone = self.own_gone.lock();
        if gone.is_empty() {
            return false;
        }
        let name = (ns.to_owned(), key.to_owned());
        self.published.lock().get(&name).is_some_and(|e| {
            gone.contains(&SharedId {
                created: e.created,
                offset: e.offset,
            })
        })
    }

    fn idle_remote(&self, id: SharedId) {
        let h = self.readers.lock().stop(id);
        if let Some(h) = h {
            self.forget_hold(h);
        }
    }

    fn hold(&self, id: SharedId, at: &Placed<'_>) {
        if at.pool != Some(self.pool.as_str()) {
            return;
        }
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        if self.readers.lock().hold(id, at.size, tag) {
            self.ack_kick.notify_one();
        }
    }

    fn pin(&self, ns: &str, key: &str, pinned: bool, at: &Placed<'_>) -> Result<()> {
        if at.pool != Some(self.pool.as_str()) {
            return Ok(());
        }
        let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
        match self.run(async move { m.read().await.pin(&n, &k, pinned).await }) {
            Ok(Some(revision)) => {
                let name = (ns.to_owned(), key.to_owned());
                self.pins
                    .lock()
                    .change(name, pinned.then_some(()), revision);
                Ok(())
            }
            Ok(None) => Err(Error::NotFound(format!(
                "{ns}/{key} (removed on another host)"
            ))),
            Err(e) => Err(unavailable(e)),
        }
    }

    fn pin_for_clients(&self, names: &[(String, String)]) -> Recording {
        let Some(outcome) = self.client_pins.pin(names) else {
            return Recording::done(Err(unavailable("the cluster runtime stopped")));
        };
        let rt = self.rt.handle().clone();
        Recording::pending(move || match blocking::wait_on(&rt, outcome) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(cluster_error(e)),
            Err(_) => Err(unavailable("the cluster runtime stopped")),
        })
    }

    fn unpin_for_clients(&self, names: &[(String, String)]) {
        self.client_pins.unpin(names);
    }

    fn pinned(&self, ns: &str, key: &str) -> Option<bool> {
        let known = self.pins.lock();
        known
            .state(&(ns.to_owned(), key.to_owned()))
            .map(|p| p.is_some())
    }

    fn set_quota(&self, ns: &str, bytes: Option<u64>) -> Result<()> {
        let (m, n) = (self.member(), ns.to_owned());
        let revision = self
            .run(async move { m.read().await.set_quota(&n, bytes).await })
            .map_err(unavailable)?;
        self.quotas.lock().change(ns.to_owned(), bytes, revision);
        Ok(())
    }

    fn quota(&self, ns: &str) -> Option<Option<u64>> {
        let known = self.quotas.lock();
        known.state(&ns.to_owned()).map(|q| q.copied())
    }

    fn accessed(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        let Some(publisher) = self.remote.lock().get(&name).map(|(p, _)| p.clone()) else {
            return;
        };
        let n = self.uses.fetch_add(1, Ordering::Relaxed);
        self.used
            .lock()
            .entry(publisher)
            .or_default()
            .insert(name, n);
    }

    fn adopt(&self, ns: &str, key: &str, id: u64) {
        self.local.adopt(ns, key, id);
    }

    fn forget(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        self.published.lock().remove(&name);
        self.remote.lock().remove(&name);
        self.local.forget(ns, key);
    }

    fn gave_way(&self, ns: &str, key: &str, id: u64) {
        // This host's publication stays recorded (`published`: its removal is asked of
        // etcd, a removal elsewhere frees its extent); filing the other entry had taken the
        // name's claim here.
        self.remote.lock().remove(&(ns.to_owned(), key.to_owned()));
        self.local.adopt(ns, key, id);
    }

    fn holder(&self, ns: &str, key: &str) -> Option<Claim> {
        self.local.holder(ns, key)
    }

    fn claim_region(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.claim_shared(pool, offset, len)
    }

    fn claim_again(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.claim_again_shared(pool, offset, len)
    }

    fn release_region(&self, pool: &str, offset: u64) {
        self.release_shared(pool, offset)
    }

    fn regions(&self, pool: &str) -> Vec<(u64, u64)> {
        self.local.regions(pool)
    }

    fn shared(&self) -> bool {
        true
    }

    fn shares(&self, pool: &str) -> bool {
        pool == self.pool
    }

    fn lost(&self, pool: &str, offset: u64) -> bool {
        pool == self.pool && self.lost.lock().contains_key(&offset)
    }

    fn fence_epoch(&self) -> u64 {
        *self.rejoins.borrow()
    }

    /// The lease's validity, as far as the entry watch has carried back the renewals'
    /// ticks (`view`), while this host is not rejoining nor catching up after a rejoin (0
    /// then): what it grants and serves of the shared pool is safe until then.
    fn fence(&self) -> Option<u64> {
        let behind = self.rejoining.load(Ordering::Acquire)
            || self.caught_up.load(Ordering::Acquire) < *self.rejoins.borrow();
        Some(if behind {
            0
        } else {
            self.valid.load(Ordering::Acquire).min(self.view.valid())
        })
    }

    fn cluster(&self) -> Option<maru::proto::ClusterInfo> {
        // Being rejoined (the write lock held): not live.
        let live = self.member.try_read().is_ok_and(|m| m.is_live());
        Some(maru::proto::ClusterInfo {
            node: self.node.clone(),
            live,
            fenced: self.fenced(),
            endpoints: self.endpoints.clone(),
            uses_reported: self.uses_reported.load(Ordering::Relaxed),
            hosts: self.hosts_info(),
            ..Default::default()
        })
    }
}

/// A cluster failure as the store reports it: a lost lease is `EBUSY` (retry once rejoined),
/// anything else etcd's unavailability.
fn cluster_error(e: maru_cluster::Error) -> Error {
    match e {
        maru_cluster::Error::LeaseLost(_) => {
            Error::Busy("this host lost its cluster lease; retry once it has rejoined".into())
        }
        e => unavailable(e),
    }
}

/// The error for a name another host has.
fn taken_error(ns: &str, key: &str, taken: &Published) -> Error {
    match taken {
        Published::Exists { record, .. } => {
            Error::Exists(format!("{ns}/{key} (published by host {})", record.node))
        }
        Published::Reserved(n) => Error::Exists(format!("{ns}/{key} (being written on host {n})")),
        Published::New { .. } => unreachable!("a new publication takes no name"),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_cluster_failure_reads_as_before_and_keeps_its_cause() {
        let e = super::unavailable(maru_cluster::Error::LeaseLost("h1".into()));
        assert_eq!(
            e.to_string(),
            "i/o error: cluster: node \"h1\" lost its etcd lease; rejoin first"
        );
        assert_eq!(e.errno(), libc::EIO);
        let maru::Error::Io(io) = &e else {
            panic!("{e:?}")
        };
        let cause = std::error::Error::source(io.get_ref().expect("wrapped")).expect("kept");
        assert!(matches!(
            cause.downcast_ref::<maru_cluster::Error>(),
            Some(maru_cluster::Error::LeaseLost(n)) if n == "h1"
        ));
    }

    /// An extent found free for a removal is taken out of the held only while it still
    /// waits for that removal: freed meanwhile and removed again, it waits for the new one.
    #[test]
    fn an_extent_is_unheld_only_for_the_removal_it_waits_for() {
        let held = parking_lot::Mutex::new(std::collections::HashMap::from([(4096, 7), (8192, 9)]));
        assert_eq!(super::unhold(&held, vec![(4096, 5), (8192, 9)]), vec![8192]);
        assert_eq!(*held.lock(), std::collections::HashMap::from([(4096, 7)]));
        assert_eq!(super::unhold(&held, vec![(4096, 7)]), vec![4096]);
        assert!(held.lock().is_empty());
        assert!(super::unhold(&held, vec![(4096, 7)]).is_empty(), "once");
    }
}
