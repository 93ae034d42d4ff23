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
//! The store calls the authority under its lock, so an etcd round trip (about a millisecond
//! on one machine) is part of every publication.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use maru::{Error, Result};
use maru_cluster::{EntryRecord, Member, NodeInfo, Published};
use parking_lot::Mutex;
use tokio::sync::RwLock;

use crate::store::authority::{Authority, Claim, LocalAuthority, Placed};

pub mod applier;

/// An entry's name: (namespace, key).
type Name = (String, String);

/// `--cluster`, `--node`, `--cluster-ttl`.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// etcd endpoints (`http://HOST:2379`).
    pub endpoints: Vec<String>,
    /// This host's name in the cluster.
    pub node: String,
    /// The lease's time to live: how long a dead or cut-off host keeps its claims.
    pub ttl: Duration,
}

fn unavailable(what: impl std::fmt::Display) -> Error {
    Error::Io(std::io::Error::other(format!("cluster: {what}")))
}

/// The metadata authority shared by the hosts of a cluster.
pub struct EtcdAuthority {
    local: LocalAuthority,
    rt: tokio::runtime::Runtime,
    member: Arc<RwLock<Member>>,
    node: String,
    /// The shared pool's device UUID.
    pool: String,
    /// Each publication of this host, by name: its etcd revision (a removal the watch reports
    /// from before it is an older entry's) and its offset.
    published: Mutex<HashMap<(String, String), (i64, u64)>>,
    /// Each entry of another host this host serves: the revision that created it (what a
    /// hold checks) and its publisher.
    remote: Mutex<HashMap<(String, String), (i64, String)>>,
    /// This host's holds on other hosts' entries, by inode here.
    holds: Mutex<HashMap<u64, Hold>>,
    next_tag: AtomicU64,
    /// A hold could not be recorded lately (etcd unreachable): new ones are queued at once,
    /// not tried on the retrieve's path, until the background recorder gets through.
    holds_stalled: std::sync::atomic::AtomicBool,
    /// Extents (offsets) this host removed that other hosts still map: freed once they let go.
    held: Mutex<HashSet<u64>>,
    /// Names this host reserved in etcd for writers through its mount.
    reserved: Mutex<HashSet<Name>>,
    /// The entries pinned in the cluster (from etcd's watch).
    pins: Mutex<HashSet<(String, String)>>,
    /// The namespaces with a quota in the cluster (from etcd's watch).
    quotas: Mutex<HashSet<String>>,
    /// Other hosts' entries used here since the last report, by publisher: name -> order.
    used: Mutex<HashMap<String, HashMap<Name, u64>>>,
    uses: AtomicU64,
    /// Uses of this host's entries other hosts reported.
    uses_reported: AtomicU64,
    /// Regions (offsets) this host could not claim again after rejoining: another host took
    /// them while this one was cut off. Nothing more is placed there.
    lost: Mutex<HashSet<u64>>,
    endpoints: Vec<String>,
    /// The hosts and what each claims, refreshed every second (for stats).
    hosts: Mutex<Vec<maru::proto::HostInfo>>,
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
            let deadline = tokio::time::Instant::now() + ttl + Duration::from_secs(3);
            loop {
                match Member::join(&eps, &pool, info.clone(), ttl).await {
                    Err(maru_cluster::Error::NodeTaken(n))
                        if tokio::time::Instant::now() < deadline =>
                    {
                        tracing::info!(node = %n, "node name still held (an earlier run's lease); waiting");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    r => return r,
                }
            }
        })?;
        tracing::info!(node = %s.node, pool = %pool_uuid, endpoints = ?s.endpoints, lease = member.lease(), "joined the cluster");
        let me = Arc::new(EtcdAuthority {
            local: LocalAuthority::default(),
            rt,
            member: Arc::new(RwLock::new(member)),
            node: s.node.clone(),
            pool: pool_uuid.to_owned(),
            published: Mutex::new(HashMap::new()),
            remote: Mutex::new(HashMap::new()),
            holds: Mutex::new(HashMap::new()),
            next_tag: AtomicU64::new(1),
            holds_stalled: std::sync::atomic::AtomicBool::new(false),
            held: Mutex::new(HashSet::new()),
            reserved: Mutex::new(HashSet::new()),
            pins: Mutex::new(HashSet::new()),
            quotas: Mutex::new(HashSet::new()),
            used: Mutex::new(HashMap::new()),
            uses: AtomicU64::new(0),
            uses_reported: AtomicU64::new(0),
            lost: Mutex::new(HashSet::new()),
            endpoints: s.endpoints.clone(),
            hosts: Mutex::new(Vec::new()),
        });
        me.rt.spawn(keep_membership(Arc::downgrade(&me)));
        me.rt.spawn(watch_hosts(Arc::downgrade(&me)));
        Ok(me)
    }

    /// Runs `f` on the cluster runtime and waits for it: driven on this thread when it is not
    /// one of a runtime's; from a runtime's thread, on a worker while this thread waits.
    fn run<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> T {
        if tokio::runtime::Handle::try_current().is_err() {
            // Not a runtime's thread (a client's connection, the applier): drive the future
            // here, with no hop to a worker and back.
            return self.rt.block_on(f);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.rt.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv().expect("the cluster runtime is running")
    }

    fn member(&self) -> Arc<RwLock<Member>> {
        self.member.clone()
    }

    /// Whether a removal the watch reports at `revision` is older than this host's current
    /// publication of the name.
    fn stale_removal(&self, ns: &str, key: &str, revision: i64) -> bool {
        self.published
            .lock()
            .get(&(ns.to_owned(), key.to_owned()))
            .is_some_and(|&(r, _)| r > revision)
    }

    /// Gives back this host's reservation of `ns/key` in etcd, if it has one (in the
    /// background: a late one only keeps the name a moment longer).
    fn drop_reservation(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        if !self.reserved.lock().remove(&name) {
            return;
        }
        let m = self.member();
        self.rt.spawn(async move {
            if let Err(e) = m.read().await.unreserve(&name.0, &name.1).await {
                tracing::warn!(ns = %name.0, key = %name.1, "giving a reservation back: {e}");
            }
        });
    }

    /// Records the holds that could not be recorded when they were taken (etcd unreachable);
    /// forgets those whose entry went meanwhile.
    async fn record_holds(&self) {
        let todo: Vec<(u64, Hold)> = self
            .holds
            .lock()
            .iter()
            .filter(|(_, h)| !h.recorded)
            .map(|(i, h)| (*i, h.clone()))
            .collect();
        for (ino, h) in todo {
            let r = self
                .member
                .read()
                .await
                .hold(&h.ns, &h.key, h.revision, (h.offset, h.len), h.tag)
                .await;
            match r {
                Ok(true) => {
                    if let Some(x) = self.holds.lock().get_mut(&ino)
                        && x.tag == h.tag
                    {
                        x.recorded = true;
                        continue;
                    }
                    // Let go of meanwhile: take the record back.
                    self.forget_hold(Hold {
                        recorded: true,
                        ..h
                    });
                }
                Ok(false) => {
                    tracing::warn!(
                        ns = %h.ns, key = %h.key,
                        "another host removed an entry a client here mapped while etcd was \
                         unreachable: its extent is no longer kept for it"
                    );
                    self.holds.lock().remove(&ino);
                }
                Err(_) => return, // still unreachable: next time
            }
        }
        self.holds_stalled.store(false, Ordering::Release);
    }

    /// Deletes hold `h`'s record in etcd, in the background (a late deletion only keeps an
    /// extent a little longer).
    fn forget_hold(&self, h: Hold) {
        if !h.recorded {
            return;
        }
        let m = self.member();
        self.rt.spawn(async move {
            if let Err(e) = m.read().await.unhold(h.offset, h.len, h.tag).await {
                tracing::warn!(offset = h.offset, "letting go of a hold: {e}");
            }
        });
    }
}

/// A hold of this host on another host's entry (see [`Authority::hold`]).
#[derive(Debug, Clone)]
struct Hold {
    ns: String,
    key: String,
    revision: i64,
    offset: u64,
    len: u64,
    /// Its records' tag (unique here): a new hold on the same extent never meets an old one's
    /// late deletion.
    tag: u64,
    /// In etcd (false while etcd is unreachable: recorded when it is back).
    recorded: bool,
    used: Instant,
}

/// Holds unused this long, with no client mapping their entry, are let go of.
const IDLE_HOLD: Duration = Duration::from_secs(2);

/// Rejoins when the lease is lost, then claims this host's regions again.
async fn keep_membership(me: std::sync::Weak<EtcdAuthority>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some(a) = me.upgrade() else { return };
        if a.member.read().await.is_live() {
            continue;
        }
        tracing::warn!(node = %a.node, "lost the cluster lease: no publication until rejoined");
        let mut m = a.member.write().await;
        if let Err(e) = m.rejoin().await {
            tracing::warn!(node = %a.node, "rejoining: {e}");
            continue;
        }
        for (off, len) in a.local.regions(&a.pool) {
            match m.claim_again(off, len).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::error!(
                        off,
                        len,
                        "a region of this host was claimed by another while this one was cut off; \
                         nothing more is placed there, and what was written there is not published"
                    );
                    a.lost.lock().insert(off);
                }
                Err(e) => tracing::warn!(off, len, "claiming a region again: {e}"),
            }
        }
        // What the old lease held is gone: the holds are recorded again (in the background),
        // the mount writers' reservations taken again where no one took the name meanwhile.
        for h in a.holds.lock().values_mut() {
            h.recorded = false;
        }
        let names: Vec<Name> = a.reserved.lock().iter().cloned().collect();
        for (ns, key) in names {
            if !matches!(m.reserve(&ns, &key).await, Ok(None)) {
                tracing::warn!(
                    ns,
                    key,
                    "a name reserved before the cut is taken: its writer's entry will not be published"
                );
                a.reserved.lock().remove(&(ns, key));
            }
        }
        tracing::info!(node = %a.node, lease = m.lease(), "rejoined the cluster");
    }
}

/// Refreshes the hosts and their claims every second, for stats.
async fn watch_hosts(me: std::sync::Weak<EtcdAuthority>) {
    loop {
        let Some(a) = me.upgrade() else { return };
        let seen = {
            let m = a.member.read().await;
            match (m.nodes().await, m.regions().await) {
                (Ok(nodes), Ok(regions)) => Some((nodes, regions)),
                _ => None,
            }
        };
        if let Some((nodes, regions)) = seen {
            let mut claimed: HashMap<String, u64> = HashMap::new();
            for holder in regions.values() {
                *claimed.entry(holder.clone()).or_default() += maru_cluster::UNIT;
            }
            let mut hosts: Vec<maru::proto::HostInfo> = nodes
                .into_iter()
                .map(|n| maru::proto::HostInfo {
                    claimed: claimed.get(&n.node).copied().unwrap_or(0),
                    entries: 0, // counted when asked (cluster())
                    node: n.node,
                    address: n.address,
                    pid: n.pid,
                })
                .collect();
            hosts.sort_by(|x, y| x.node.cmp(&y.node));
            *a.hosts.lock() = hosts;
        }
        drop(a);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

impl Authority for EtcdAuthority {
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        self.local.reserve(ns, key, id)
    }

    fn reserve_everywhere(&self, ns: &str, key: &str, id: u64, pool: Option<&str>) -> Result<()> {
        self.local.reserve(ns, key, id)?;
        let name = (ns.to_owned(), key.to_owned());
        if pool != Some(self.pool.as_str()) || self.reserved.lock().contains(&name) {
            return Ok(());
        }
        let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
        let e = match self.run(async move { m.read().await.reserve(&n, &k).await }) {
            Ok(None) => {
                self.reserved.lock().insert(name);
                return Ok(());
            }
            Ok(Some(taken)) => taken_error(ns, key, &taken),
            Err(maru_cluster::Error::LeaseLost(_)) => {
                Error::Busy("this host lost its cluster lease; retry once it has rejoined".into())
            }
            Err(e) => unavailable(e),
        };
        self.local.release(ns, key, id);
        Err(e)
    }

    fn publish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<()> {
        self.local.publish(ns, key, id, at)?;
        if at.pool != Some(self.pool.as_str()) {
            return Ok(()); // not the shared pool: this host's alone
        }
        let rec = EntryRecord {
            offset: at.offset,
            len: at.size,
            node: self.node.clone(),
            alloc: id,
        };
        let name = (ns.to_owned(), key.to_owned());
        let reserved = self.reserved.lock().contains(&name);
        let (m, n, k, r) = (self.member(), ns.to_owned(), key.to_owned(), rec.clone());
        let outcome = self.run(async move {
            let m = m.read().await;
            if reserved {
                m.publish_reserved(&n, &k, &r).await
            } else {
                m.publish(&n, &k, &r).await
            }
        });
        if matches!(outcome, Ok(Published::New { .. })) {
            self.reserved.lock().remove(&name);
        }
        let refused = match outcome {
            Ok(Published::New { revision }) => {
                self.published
                    .lock()
                    .insert((ns.to_owned(), key.to_owned()), (revision, at.offset));
                return Ok(());
            }
            // This host's own record (a restart recovering what it published).
            Ok(Published::Exists(r)) if r.node == self.node && r.offset == at.offset => {
                return Ok(());
            }
            Ok(taken) => taken_error(ns, key, &taken),
            Err(maru_cluster::Error::LeaseLost(_)) => {
                Error::Busy("this host lost its cluster lease; retry once it has rejoined".into())
            }
            // Written into a region another host took while this one was cut off: those
            // bytes are not this host's to publish.
            Err(e @ maru_cluster::Error::NotClaimed { .. }) => Error::Busy(e.to_string()),
            Err(e) => {
                // The outcome is unknown: take the record back if it made it.
                let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
                if let Err(e2) = self.run(async move { m.read().await.retract(&n, &k, &rec).await })
                {
                    tracing::error!(
                        ns,
                        key,
                        "publication failed ({e}) and could not be taken back: {e2}"
                    );
                }
                unavailable(e)
            }
        };
        self.drop_reservation(ns, key);
        self.local.release(ns, key, id);
        Err(refused)
    }

    fn release(&self, ns: &str, key: &str, id: u64) {
        if self.local.holder(ns, key) == Some(Claim::Reserved(id)) {
            self.drop_reservation(ns, key);
        }
        let published = self.local.holder(ns, key) == Some(Claim::Published(id));
        let name = (ns.to_owned(), key.to_owned());
        let offset = self.published.lock().get(&name).map(|&(_, o)| o);
        if let (true, Some(offset)) = (published, offset) {
            let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
            if let Err(e) = self.run(async move { m.read().await.remove(&n, &k, offset).await }) {
                tracing::error!(ns, key, "removing the entry from the cluster: {e}");
            }
            self.published.lock().remove(&name);
        }
        self.local.release(ns, key, id);
    }

    fn unpublish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<bool> {
        let name = (ns.to_owned(), key.to_owned());
        if at.pool != Some(self.pool.as_str())
            || self.local.holder(ns, key) != Some(Claim::Published(id))
        {
            self.local.release(ns, key, id);
            return Ok(false);
        }
        let (m, n, k, offset) = (self.member(), ns.to_owned(), key.to_owned(), at.offset);
        let removed = self
            .run(async move { m.read().await.remove(&n, &k, offset).await })
            .map_err(unavailable)?;
        self.published.lock().remove(&name);
        // Only this host's own extents are its to keep for the others.
        let own = self.remote.lock().remove(&name).is_none();
        self.local.release(ns, key, id);
        if removed.held && own {
            self.held.lock().insert(at.offset);
        }
        Ok(removed.held && own)
    }

    fn held_elsewhere(&self, pool: &str, offset: u64) -> bool {
        pool == self.pool && self.held.lock().contains(&offset)
    }

    fn hold(&self, ns: &str, key: &str, ino: u64, at: &Placed<'_>) -> Result<bool> {
        if let Some(h) = self.holds.lock().get_mut(&ino) {
            h.used = Instant::now();
            return Ok(true);
        }
        let Some(revision) = self
            .remote
            .lock()
            .get(&(ns.to_owned(), key.to_owned()))
            .map(|(r, _)| *r)
        else {
            return Ok(false);
        };
        let mut h = Hold {
            ns: ns.to_owned(),
            key: key.to_owned(),
            revision,
            offset: at.offset,
            len: at.size,
            tag: self.next_tag.fetch_add(1, Ordering::Relaxed),
            recorded: false,
            used: Instant::now(),
        };
        // etcd unreachable (or this host cut off): reads go on; the hold is recorded once
        // etcd answers again (doc/CLUSTER.md, "Leases on extents across hosts").
        let live = self.member.try_read().is_ok_and(|m| m.is_live());
        if live && !self.holds_stalled.load(Ordering::Acquire) {
            let (m, c) = (self.member(), h.clone());
            let r = self.run(async move {
                m.read()
                    .await
                    .hold(&c.ns, &c.key, c.revision, (c.offset, c.len), c.tag)
                    .await
            });
            match r {
                Ok(true) => h.recorded = true,
                Ok(false) => return Ok(false),
                Err(e) => {
                    tracing::warn!(ns, key, "cannot record a hold yet: {e}");
                    self.holds_stalled.store(true, Ordering::Release);
                }
            }
        }
        self.holds.lock().insert(ino, h);
        Ok(true)
    }

    fn pin(&self, ns: &str, key: &str, pinned: bool, at: &Placed<'_>) -> Result<()> {
        if at.pool != Some(self.pool.as_str()) {
            return Ok(());
        }
        let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
        match self.run(async move { m.read().await.pin(&n, &k, pinned).await }) {
            Ok(true) => {
                let name = (ns.to_owned(), key.to_owned());
                if pinned {
                    self.pins.lock().insert(name);
                } else {
                    self.pins.lock().remove(&name);
                }
                Ok(())
            }
            Ok(false) => Err(Error::NotFound(format!(
                "{ns}/{key} (removed on another host)"
            ))),
            Err(e) => Err(unavailable(e)),
        }
    }

    fn set_quota(&self, ns: &str, bytes: Option<u64>) -> Result<()> {
        let (m, n) = (self.member(), ns.to_owned());
        self.run(async move { m.read().await.set_quota(&n, bytes).await })
            .map_err(unavailable)
    }

    fn accessed(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        let Some(publisher) = self.remote.lock().get(&name).map(|(_, n)| n.clone()) else {
            return;
        };
        let n = self.uses.fetch_add(1, Ordering::Relaxed);
        self.used
            .lock()
            .entry(publisher)
            .or_default()
            .insert(name, n);
    }

    fn unhold(&self, ino: u64) {
        let h = self.holds.lock().remove(&ino);
        if let Some(h) = h {
            self.forget_hold(h);
        }
    }

    fn drop_idle_holds(&self, leased: &dyn Fn(u64) -> bool) {
        let idle: Vec<Hold> = {
            let mut holds = self.holds.lock();
            let inos: Vec<u64> = holds
                .iter()
                .filter(|(i, h)| h.used.elapsed() >= IDLE_HOLD && !leased(**i))
                .map(|(i, _)| *i)
                .collect();
            inos.iter().filter_map(|i| holds.remove(i)).collect()
        };
        for h in idle {
            self.forget_hold(h);
        }
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

    fn holder(&self, ns: &str, key: &str) -> Option<Claim> {
        self.local.holder(ns, key)
    }

    fn claim_region(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.local.claim_region(pool, offset, len)?;
        if pool != self.pool {
            return Ok(());
        }
        let m = self.member();
        let r = self.run(async move { m.read().await.claim(offset, len).await });
        tracing::debug!(offset, len, ?r, "claim");
        let e = match r {
            Ok(true) => return Ok(()),
            Ok(false) => Error::Busy(format!(
                "region {offset:#x}+{len:#x} is claimed by another host"
            )),
            Err(maru_cluster::Error::LeaseLost(_)) => {
                unavailable("this host lost its lease; no region until it has rejoined")
            }
            Err(e) => unavailable(e),
        };
        self.local.release_region(pool, offset);
        Err(e)
    }

    fn claim_again(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.local.claim_region(pool, offset, len)?;
        if pool != self.pool {
            return Ok(());
        }
        let m = self.member();
        match self.run(async move { m.read().await.claim_again(offset, len).await }) {
            Ok(true) => Ok(()),
            r => {
                self.local.release_region(pool, offset);
                Err(match r {
                    Ok(_) => Error::Busy(format!(
                        "region {offset:#x}+{len:#x} is claimed by another host"
                    )),
                    Err(e) => unavailable(e),
                })
            }
        }
    }

    fn release_region(&self, pool: &str, offset: u64) {
        let len = self
            .local
            .regions(pool)
            .into_iter()
            .find(|&(o, _)| o == offset)
            .map(|(_, l)| l);
        self.local.release_region(pool, offset);
        if self.lost.lock().remove(&offset) {
            return; // another host's now: nothing of it to give back
        }
        if let (Some(len), true) = (len, pool == self.pool) {
            let m = self.member();
            if let Err(e) = self.run(async move { m.read().await.release(offset, len).await }) {
                tracing::warn!(offset, len, "releasing a region in the cluster: {e}");
            }
        }
    }

    fn regions(&self, pool: &str) -> Vec<(u64, u64)> {
        self.local.regions(pool)
    }

    fn shared(&self) -> bool {
        true
    }

    fn lost(&self, pool: &str, offset: u64) -> bool {
        pool == self.pool && self.lost.lock().contains(&offset)
    }

    fn cluster(&self) -> Option<maru::proto::ClusterInfo> {
        // Being rejoined (the write lock held): not live.
        let live = self.member.try_read().is_ok_and(|m| m.is_live());
        Some(maru::proto::ClusterInfo {
            node: self.node.clone(),
            live,
            endpoints: self.endpoints.clone(),
            uses_reported: self.uses_reported.load(Ordering::Relaxed),
            hosts: {
                let mut by_node: HashMap<&str, u64> = HashMap::new();
                let remote = self.remote.lock();
                for (_, node) in remote.values() {
                    *by_node.entry(node).or_default() += 1;
                }
                let mut hosts = self.hosts.lock().clone();
                for h in &mut hosts {
                    h.entries = by_node.get(h.node.as_str()).copied().unwrap_or(0);
                }
                hosts
            },
            ..Default::default()
        })
    }
}

/// The error for a name another host has.
fn taken_error(ns: &str, key: &str, taken: &Published) -> Error {
    match taken {
        Published::Exists(r) => Error::Exists(format!("{ns}/{key} (published by host {})", r.node)),
        Published::Reserved(n) => Error::Exists(format!("{ns}/{key} (being written on host {n})")),
        Published::New { .. } => unreachable!("a new publication takes no name"),
    }
}
