//! The applier: keeps the store fed with what the other hosts do, from etcd's watches (entries,
//! pins, quotas, reports of use), and frees this host's removed extents once every host has
//! let go of them.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use maru_cluster::{EntryEvent, EntryRecord, Member};
use tokio::sync::RwLock;

use super::changes::Change;
use super::view::Lag;
use super::{EtcdAuthority, Name};
use crate::store::authority::Gone;
use crate::store::{SharedId, Store};

/// Feeds `store` with the entries the other hosts publish and remove: a snapshot, then the
/// watch from the next revision (again from a fresh snapshot whenever the watch breaks).
pub fn start_applier(store: Arc<Store>, auth: Arc<EtcdAuthority>) -> anyhow::Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Change>();
    let tx2 = tx.clone();
    auth.changing.apply_to(tx.clone());
    let m = auth.member();
    let me = Arc::downgrade(&auth);
    let mut rejoins = auth.rejoins.subscribe();
    let (caught_up, mut first) = tokio::sync::watch::channel(false);
    // The store is recovered: this run's entries are told apart from those earlier runs of
    // this node published and it did not recover (`View::own`).
    let from = auth.rt.block_on(async { m.read().await.epoch() });
    let recovered = auth
        .published
        .lock()
        .values()
        .filter(|e| e.created < from)
        .map(|e| SharedId {
            created: e.created,
            offset: e.offset,
        })
        .collect();
    auth.view.this_run(from, recovered);
    let fence_store = store.clone();
    auth.rt.spawn(async move {
        let mut retry = Retry::default();
        loop {
            // After a rejoin the host is fenced off until an entire read like this one is
            // applied: it may have missed removals while cut off. The rejoins are counted
            // under the membership's write lock, so a count read under its read lock, held
            // while the read is made, is of rejoins all done before the read began, and no
            // other can finish until it ends: one read after a rejoin unfences the host.
            // (Counted before the lock, a read that waited on a rejoin counted the one
            // before and took a second read, and a watch between the two, to unfence.)
            let snap = {
                let m = m.read().await;
                let epoch = *rejoins.borrow_and_update();
                m.snapshot().await.map(|s| (s, epoch))
            };
            let (snap, epoch) = match snap {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("cluster: reading the entries: {e}");
                    retry.wait(&mut rejoins).await;
                    continue;
                }
            };
            // Applied before anything later is acknowledged: what the snapshot no longer has
            // was removed while the watch was down, and only the store knows who maps it.
            let (done, applied) = tokio::sync::oneshot::channel();
            let (rev, fresh_until) = (snap.revision, snap.fresh_until);
            let Some(a) = me.upgrade() else { return };
            a.view.read(&snap);
            a.lose_occupied();
            let lag_limit = m.read().await.ttl() / 3;
            drop(a);
            if tx.send(Change::All(snap, done)).is_err() || applied.await.is_err() {
                return;
            }
            match me.upgrade() {
                Some(a) => {
                    a.view.applied(fresh_until);
                    a.caught_up.fetch_max(epoch, Ordering::AcqRel);
                    // The indexes say so at once (clients trust them again), not at the next
                    // tick of `publish_fence`.
                    let until = crate::store::authority::Authority::fence(&*a).unwrap_or(0).max(1);
                    let s = fence_store.clone();
                    let _ = tokio::task::spawn_blocking(move || s.set_fence(until)).await;
                }
                None => return,
            };
            caught_up.send_replace(true);
            tracing::debug!(revision = rev, epoch, "cluster: every entry read and applied");
            let watch = m.read().await.watch_entries(rev + 1).await;
            let Ok(mut w) = watch else {
                retry.wait(&mut rejoins).await;
                continue;
            };
            retry = Retry::default();
            let (mut check, mut lag) = (tokio::time::interval(LAG_CHECK), Lag::new(lag_limit));
            loop {
                let next = tokio::select! {
                    next = w.next() => next,
                    _ = rejoins.changed() => {
                        tracing::info!("cluster: rejoined; reading the entries again");
                        break;
                    }
                    _ = check.tick() => {
                        let Some(a) = me.upgrade() else { return };
                        if lag.lags(&a.view) {
                            tracing::warn!("cluster: the entry watch lags (this host's renewals do not come back through it); reading the entries again");
                            break;
                        }
                        continue;
                    }
                };
                let view = me.upgrade().map(|a| a.view.clone());
                if let Some(v) = view {
                    v.gate().await;
                }
                match next {
                    Ok(Some(ev @ EntryEvent::Tick { .. })) => {
                        let Some(a) = me.upgrade() else { return };
                        a.view.event(&ev);
                    }
                    Ok(Some(EntryEvent::Delete {
                        ns, name, record: None, ..
                    })) => {
                        tracing::warn!(ns, name, "cluster: a removal without its record; reading the entries again");
                        break;
                    }
                    Ok(Some(ev)) => {
                        let Some(a) = me.upgrade() else { return };
                        a.view.event(&ev);
                        let (change, removal) = match ev {
                            // A removal is acknowledged from here, not after the store applied
                            // it (which may wait for the store's lock, held by a removal of
                            // this host waiting for the acknowledgements of others).
                            EntryEvent::Delete {
                                ns,
                                name,
                                revision,
                                created,
                                record: Some(rec),
                            } => {
                                let entry = SharedId {
                                    created,
                                    offset: rec.offset,
                                };
                                a.on_removal(entry, rec.len);
                                let key = name;
                                (Change::Removed { ns, key, revision, entry }, Some(revision))
                            }
                            ev => (Change::Event(ev), None),
                        };
                        if tx.send(change).is_err() {
                            return;
                        }
                        if let Some(revision) = removal {
                            a.applied(revision);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("cluster: the entry watch ended; reading the entries again");
                        break;
                    }
                }
            }
        }
    });
    auth.rt.spawn(follow::<Pins>(auth.member(), tx2.clone()));
    auth.rt.spawn(follow::<Quotas>(auth.member(), tx2.clone()));
    auth.rt
        .spawn(follow::<ClientPins>(auth.member(), tx2.clone()));
    auth.rt.spawn(watch_uses(auth.member(), tx2.clone()));
    auth.rt.spawn(tend(Arc::downgrade(&auth), tx2.clone()));
    auth.rt.spawn(publish_fence(Arc::downgrade(&auth), tx2));
    let applying = auth.clone();
    std::thread::Builder::new()
        .name("maru-cluster-apply".into())
        .spawn(move || {
            while let Some(c) = rx.blocking_recv() {
                apply(&store, &applying, c);
            }
        })?;
    // marud serves once every entry is read and applied (until then it is fenced off the
    // shared pool); an etcd that does not answer in time lets it start fenced.
    let read = auth
        .rt
        .block_on(async { tokio::time::timeout(FIRST_READ, first.wait_for(|read| *read)).await });
    if !matches!(read, Ok(Ok(_))) {
        tracing::warn!(
            "cluster: the entries are not read yet; serving, fenced off the pool until they are"
        );
    }
    Ok(())
}

/// The applier's pause after a failed read or watch: 50 ms, doubled after each failure up to
/// 1 s, cut short by a rejoin. Failures after a cut heals come from connections the cut left
/// (a request on one fails at once, or when its keep-alive ends it): a flat second after each
/// kept a rejoined host fenced off, and blind, for up to two seconds more (seed 2275).
struct Retry(Duration);

impl Default for Retry {
    fn default() -> Self {
        Retry(Duration::from_millis(50))
    }
}

impl Retry {
    async fn wait(&mut self, rejoins: &mut tokio::sync::watch::Receiver<u64>) {
        tokio::select! {
            _ = tokio::time::sleep(self.0) => {}
            Ok(()) = rejoins.changed() => {}
        }
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
    }
}

/// How often the applier looks whether its entry watch lags ([`Lag`]).
const LAG_CHECK: Duration = Duration::from_millis(250);

/// How long marud waits at its start for its first read of every entry.
const FIRST_READ: Duration = Duration::from_secs(30);

/// A kind of record every host follows: all of them at a revision, then every change.
trait Followed: Send + 'static {
    type Watch: Send;
    /// All of them, as one change, and the revision they were read at.
    fn all(m: &Member) -> impl Future<Output = maru_cluster::Result<(Change, i64)>> + Send;
    fn watch(
        m: &Member,
        from: i64,
    ) -> impl Future<Output = maru_cluster::Result<Self::Watch>> + Send;
    /// The next change; None when the watch ended.
    fn next(w: &mut Self::Watch) -> impl Future<Output = Option<Change>> + Send;
}

/// The pins (`pins/`).
struct Pins;

impl Followed for Pins {
    type Watch = maru_cluster::PinWatch;
    async fn all(m: &Member) -> maru_cluster::Result<(Change, i64)> {
        m.pins()
            .await
            .map(|(all, rev)| (Change::Pins(all, rev), rev))
    }
    async fn watch(m: &Member, from: i64) -> maru_cluster::Result<Self::Watch> {
        m.watch_pins(from).await
    }
    async fn next(w: &mut Self::Watch) -> Option<Change> {
        let (ns, key, pinned, revision) = w.next().await.ok().flatten()?;
        Some(Change::Pin(ns, key, pinned, revision))
    }
}

/// The quotas (`quotas/`).
struct Quotas;

impl Followed for Quotas {
    type Watch = maru_cluster::QuotaWatch;
    async fn all(m: &Member) -> maru_cluster::Result<(Change, i64)> {
        m.quotas()
            .await
            .map(|(all, rev)| (Change::Quotas(all, rev), rev))
    }
    async fn watch(m: &Member, from: i64) -> maru_cluster::Result<Self::Watch> {
        m.watch_quotas(from).await
    }
    async fn next(w: &mut Self::Watch) -> Option<Change> {
        let (ns, bytes, revision) = w.next().await.ok().flatten()?;
        Some(Change::Quota(ns, bytes, revision))
    }
}

/// The pins of clients of every host (`clientpins/`).
struct ClientPins;

impl Followed for ClientPins {
    type Watch = maru_cluster::ClientPinWatch;
    async fn all(m: &Member) -> maru_cluster::Result<(Change, i64)> {
        m.client_pins()
            .await
            .map(|(all, rev)| (Change::ClientPins(all), rev))
    }
    async fn watch(m: &Member, from: i64) -> maru_cluster::Result<Self::Watch> {
        m.watch_client_pins(from).await
    }
    async fn next(w: &mut Self::Watch) -> Option<Change> {
        let (ns, key, node, pinned) = w.next().await.ok().flatten()?;
        Some(Change::ClientPin(ns, key, node, pinned))
    }
}

/// Feeds the applier with records of kind `F`: all of them, then every change (again from
/// all of them whenever the watch breaks).
async fn follow<F: Followed>(
    m: Arc<RwLock<Member>>,
    tx: tokio::sync::mpsc::UnboundedSender<Change>,
) {
    loop {
        let snap = F::all(&*m.read().await).await;
        let Ok((all, rev)) = snap else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        if tx.send(all).is_err() {
            return;
        }
        let watch = F::watch(&*m.read().await, rev + 1).await;
        if let Ok(mut w) = watch {
            while let Some(c) = F::next(&mut w).await {
                if tx.send(c).is_err() {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Every 100 ms, the fence (`EtcdAuthority::fence`) for the indexes clients read: a value
/// the fence had a moment ago, so never later than it is; 1 (passed) rather than 0 (none).
async fn publish_fence(
    me: std::sync::Weak<EtcdAuthority>,
    tx: tokio::sync::mpsc::UnboundedSender<Change>,
) {
    use crate::store::authority::Authority;
    let mut last = None;
    let mut was_fenced = false;
    loop {
        let Some(a) = me.upgrade() else { return };
        let until = a.fence().unwrap_or(0).max(1);
        let fenced = a.fenced();
        if fenced != was_fenced {
            tracing::info!(
                fenced,
                until,
                now = maru::index::boottime_ns(),
                valid = a.valid.load(Ordering::Acquire),
                view_valid = a.view.valid(),
                rejoining = a.rejoining.load(Ordering::Acquire),
                caught_up = a.caught_up.load(Ordering::Acquire),
                rejoins = *a.rejoins.borrow(),
                "cluster: the shared pool is {}",
                if fenced { "fenced off" } else { "served again" }
            );
            was_fenced = fenced;
        }
        drop(a);
        if last != Some(until) {
            if tx.send(Change::Fence(until)).is_err() {
                return;
            }
            last = Some(until);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Feeds the applier with the uses of this host's entries other hosts report.
async fn watch_uses(m: Arc<RwLock<Member>>, tx: tokio::sync::mpsc::UnboundedSender<Change>) {
    loop {
        let watch = m.read().await.watch_access().await;
        if let Ok(mut w) = watch {
            while let Ok(Some(used)) = w.next().await {
                if tx.send(Change::Used(used)).is_err() {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// At most this many uses go in one report to one host (the most recent).
const REPORT_MAX: usize = 4096;

impl EtcdAuthority {
    /// Reports to each host the uses of its entries here since the last report.
    async fn report_uses(&self) {
        let batches = std::mem::take(&mut *self.used.lock());
        for (publisher, used) in batches {
            let mut used: Vec<((String, String), u64)> = used.into_iter().collect();
            used.sort_by_key(|(_, n)| *n);
            let from = used.len().saturating_sub(REPORT_MAX);
            let names: Vec<(String, String)> = used.drain(from..).map(|(k, _)| k).collect();
            let r = self
                .member
                .read()
                .await
                .report_access(&publisher, &names)
                .await;
            if let Err(e) = r {
                tracing::debug!(publisher, "reporting uses: {e}"); // an approximation: dropped
            }
        }
    }
}

/// Every 200 ms, and whenever another host acknowledges: frees the removed extents of this
/// host that every live host acknowledged the removal of and none holds, and sweeps the
/// tombstones of this host's removals that every live host acknowledged (every 2 s, those
/// of hosts gone too); every second, reports uses of other hosts' entries.
async fn tend(me: std::sync::Weak<EtcdAuthority>, tx: tokio::sync::mpsc::UnboundedSender<Change>) {
    let Some(mut seen) = me.upgrade().map(|a| a.acks_seen.subscribe()) else {
        return;
    };
    let mut next_report = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut next_sweep = tokio::time::Instant::now();
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), seen.changed()).await;
        let Some(a) = me.upgrade() else { return };
        let now = tokio::time::Instant::now();
        if a.tombstones.swap(false, Ordering::AcqRel) || now >= next_sweep {
            next_sweep = now + Duration::from_secs(2);
            let others = *a.others_removed.lock();
            let left = a.member.read().await.sweep().await;
            if left.is_ok_and(|n| n == 0) {
                tracing::trace!("cluster: every tombstone of this host's swept");
                a.swept_others(others);
            } else {
                a.tombstones.store(true, Ordering::Release);
            }
        }
        let pending: Vec<(u64, i64)> = a.held.lock().iter().map(|(o, r)| (*o, *r)).collect();
        let others = *a.others_removed.lock();
        if pending.is_empty() && others.is_none() {
            a.settle_stalled.store(false, Ordering::Release);
        } else {
            let m = a.member.read().await;
            if let Ok(acked) = m.acknowledged().await {
                let removals = pending.iter().map(|(_, r)| *r).chain(others);
                if removals.into_iter().all(|r| acked.is_none_or(|x| x >= r)) {
                    a.settle_stalled.store(false, Ordering::Release);
                }
                let free = super::free_of(&m, &pending, acked).await;
                // Not freed by a `settle` meanwhile (nor freed and removed again since).
                for o in super::unhold(&a.held, free.unwrap_or_default()) {
                    if tx.send(Change::Unheld(o)).is_err() {
                        return;
                    }
                }
            }
        }
        if tokio::time::Instant::now() >= next_report {
            next_report += Duration::from_secs(1);
            a.report_uses().await;
        }
    }
}

fn apply(store: &Store, auth: &EtcdAuthority, c: Change) {
    match c {
        Change::Release(ns, key) => {
            for (read, c) in auth.changing.release(&ns, &key) {
                tracing::debug!(ns, key, "a change held back, applied");
                apply(store, auth, Change::Held(read, Box::new(c)));
            }
        }
        Change::Held(read, c) => {
            if auth.changing.superseded(read) {
                tracing::debug!(
                    "a change held back, passed by: a later read of every entry has it"
                );
            } else {
                apply(store, auth, *c);
            }
        }
        Change::All(mut all, done) => {
            auth.changing.read_begins();
            let revision = all.revision;
            let snap: HashMap<Name, (i64, EntryRecord)> = std::mem::take(&mut all.entries)
                .into_iter()
                .map(|l| ((l.ns, l.name), (l.revision, l.record)))
                .collect();
            tracing::debug!(revision, entries = snap.len(), "every entry, read");
            // Removed while the watch was down (and maybe published again since, by any
            // host): other hosts' entries that are gone or not the ones listed, and this
            // host's own published before the read that are gone or not its own any more.
            // Another host's is refused to new readers, and held if clients here map it, as
            // a removal the watch brings is (`on_removal`), before the read is acknowledged.
            for e in store.remote_entries() {
                let name = (e.ns, e.key);
                if snap.get(&name).is_none_or(|(c, _)| *c != e.created) {
                    tracing::debug!(
                        ns = name.0,
                        key = name.1,
                        created = e.created,
                        "gone while the watch was down"
                    );
                    let entry = SharedId {
                        created: e.created,
                        offset: e.offset,
                    };
                    auth.on_removal(entry, e.size);
                    removed(store, auth, &name.0, &name.1, revision, entry);
                }
            }
            // This host's own wait for every live host's acknowledgement of the removal
            // itself, not of this read (which none gives until the entries change again).
            let gone: Vec<(Name, SharedId, i64)> = auth
                .published
                .lock()
                .iter()
                .filter(|(name, e)| {
                    e.created <= revision && snap.get(*name).is_none_or(|(c, _)| *c != e.created)
                })
                .map(|(name, e)| {
                    let entry = SharedId {
                        created: e.created,
                        offset: e.offset,
                    };
                    (name.clone(), entry, all.removed_at(e.offset, e.created))
                })
                .collect();
            for ((ns, key), entry, at) in gone {
                tracing::info!(
                    ns,
                    key,
                    at,
                    "cluster: removed elsewhere while the watch was down"
                );
                removed(store, auth, &ns, &key, at, entry);
            }
            // Another host's, or an earlier run's that this one did not recover.
            for ((ns, key), (created, rec)) in &snap {
                if !auth.view.own(rec, *created) {
                    file(store, auth, ns, key, rec, *created);
                }
            }
            let served = store.remote_entries().into_iter().map(|e| SharedId {
                created: e.created,
                offset: e.offset,
            });
            auth.refusals_only_for(&served.collect());
            auth.applied(revision);
            let _ = done.send(());
        }
        Change::Event(EntryEvent::Put {
            ns,
            name,
            record,
            revision,
        }) => {
            if !auth.view.own(&record, revision) {
                file(store, auth, &ns, &name, &record, revision);
            }
        }
        Change::Removed {
            ns,
            key,
            revision,
            entry,
        } => removed(store, auth, &ns, &key, revision, entry),
        // The watch's task takes the ticks (`view`) and sends removals as `Change::Removed`:
        // none is queued.
        Change::Event(EntryEvent::Tick { .. } | EntryEvent::Delete { .. }) => {}
        Change::Fence(until) => {
            tracing::debug!(
                until,
                now = maru::index::boottime_ns(),
                "the indexes' fence"
            );
            store.set_fence(until)
        }
        Change::Unheld(offset) => {
            tracing::debug!(offset, "a removed extent of this host's is freed");
            store.free_unheld(&auth.pool, offset)
        }
        Change::Pins(all, revision) => {
            // Read before this host's latest pins and unpins, maybe: those stand.
            let all = all.into_iter().map(|name| (name, ())).collect();
            let changed = auth.pins.lock().all(all, revision);
            for ((ns, key), pinned) in changed {
                store.pin_elsewhere(&ns, &key, pinned.is_some());
            }
        }
        Change::Used(used) => {
            auth.uses_reported
                .fetch_add(used.len() as u64, Ordering::Relaxed);
            store.used_elsewhere(&used);
        }
        Change::Quotas(all, revision) => {
            // Read before this host's latest quotas, maybe: those stand.
            let changed = auth.quotas.lock().all(all, revision);
            for (ns, bytes) in changed {
                store.quota_elsewhere(&ns, bytes);
            }
        }
        Change::Quota(ns, bytes, revision) => {
            if auth.quotas.lock().seen(ns.clone(), bytes, revision) {
                store.quota_elsewhere(&ns, bytes);
            }
        }
        Change::ClientPins(all) => {
            let mut now: HashMap<Name, HashSet<String>> = HashMap::new();
            for (ns, key, node) in all {
                now.entry((ns, key)).or_default().insert(node);
            }
            let before = std::mem::replace(&mut *auth.client_pinned.lock(), now.clone());
            for name in before.keys().filter(|n| !now.contains_key(*n)) {
                store.client_pin_elsewhere(&name.0, &name.1, false);
            }
            for name in now.keys() {
                store.client_pin_elsewhere(&name.0, &name.1, true);
            }
        }
        Change::ClientPin(ns, key, node, pinned) => {
            let name = (ns, key);
            let any = {
                let mut all = auth.client_pinned.lock();
                let nodes = all.entry(name.clone()).or_default();
                if pinned {
                    nodes.insert(node);
                } else {
                    nodes.remove(&node);
                }
                let any = !nodes.is_empty();
                if !any {
                    all.remove(&name);
                }
                any
            };
            store.client_pin_elsewhere(&name.0, &name.1, any);
        }
        Change::Pin(ns, key, pinned, revision) => {
            let name = (ns.clone(), key.clone());
            if auth.pins.lock().seen(name, pinned.then_some(()), revision) {
                store.pin_elsewhere(&ns, &key, pinned);
            }
        }
    }
}

/// Entry `ns/name` (`entry`: created at its revision, at its offset) was removed at
/// `revision`: whichever entry of the name this host has goes if it is that one (this host's
/// publication, or another host's entry it serves), not a newer one of the name. Held back while this host
/// is changing the name; another host's entry leaves the index meanwhile, and stays refused
/// to new readers until the removal applies (seed 906: held back after a rejoin, it was
/// served from its extent, carved again while the host was cut off).
fn removed(
    store: &Store,
    auth: &EtcdAuthority,
    ns: &str,
    name: &str,
    revision: i64,
    entry: SharedId,
) {
    let created = entry.created;
    let mut change = Change::Removed {
        ns: ns.to_owned(),
        key: name.to_owned(),
        revision,
        entry,
    };
    let own_of = || {
        auth.published
            .lock()
            .get(&(ns.to_owned(), name.to_owned()))
            .filter(|e| e.created == created)
            .map(|e| e.offset)
    };
    loop {
        match auth.changing.hold_back(ns, name, change) {
            Some(c) => change = c,
            None => {
                // Refused to new readers meanwhile, this host's own entry too (seed 2423:
                // removed while this host was cut off, in a region another host took then,
                // it was served after the rejoin's read from its extent carved again).
                let gone = match own_of() {
                    Some(_) => {
                        auth.own_gone.lock().insert(entry);
                        Gone::Own
                    }
                    None => Gone::Remote(created),
                };
                store.unindex_removed(ns, name, gone);
                return;
            }
        }
        // An entry of this host's that another host removed: its extent stays until every
        // live host acknowledged the removal and none holds it.
        let own = own_of();
        tracing::debug!(ns, name, revision, created, own = own.is_some(), "removed");
        if let Some(offset) = own {
            auth.held.lock().insert(offset, revision);
        }
        // Another host's: this host holds it already if clients here map it.
        let gone = match own {
            Some(_) => Gone::Own,
            None => Gone::Remote(created),
        };
        if store.forget_remote(ns, name, gone) {
            auth.removal_applied(entry);
            auth.own_gone.lock().remove(&entry);
            return;
        }
        // The store began withdrawing the name meanwhile: held back in turn.
    }
}

/// Another host's entry `ns/key` (created at revision `created`), or one an earlier run of
/// this node published and this run did not recover: filed here. Held back while this host
/// is changing the name.
fn file(store: &Store, auth: &EtcdAuthority, ns: &str, key: &str, rec: &EntryRecord, created: i64) {
    let mut change = Change::Event(EntryEvent::Put {
        ns: ns.to_owned(),
        name: key.to_owned(),
        record: rec.clone(),
        revision: created,
    });
    loop {
        match auth.changing.hold_back(ns, key, change) {
            Some(c) => change = c,
            None => return,
        }
        tracing::debug!(ns, key, node = %rec.node, offset = rec.offset, len = rec.len, created, "another host's entry");
        auth.remote
            .lock()
            .insert((ns.to_owned(), key.to_owned()), (rec.node.clone(), created));
        match store.file_remote(&auth.pool, ns, key, rec.offset, rec.len, created) {
            Ok(true) => break,
            // The store began withdrawing the name's entry here meanwhile: held back in turn.
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(ns, key, node = %rec.node, "cannot serve another host's entry: {e}");
                return;
            }
        }
    }
    // Pinned before this host learnt of it (the pins have a watch of their own).
    if auth
        .pins
        .lock()
        .get(&(ns.to_owned(), key.to_owned()))
        .is_some()
    {
        store.pin_elsewhere(ns, key, true);
    }
}
