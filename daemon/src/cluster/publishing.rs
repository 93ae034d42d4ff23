//! Publications and removals of this host's entries in etcd, through the group commit
//! (`group`): the authority's side of a store's publication and delete; and the names this
//! host reserves for its mount's writers, given back until etcd takes them (`reservations`).

use std::sync::atomic::Ordering;

use maru::{Error, Result};
use maru_cluster::{EntryAt, EntryRecord, Published};

use super::group::{Item, Withdrawal};
use super::{EtcdAuthority, Name, cluster_error, taken_error, unavailable};
use crate::store::authority::{Authority, Claim, Publishing, Withdrawn};

/// How long a publication whose outcome etcd did not tell waits for etcd to say.
const RESOLVE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

impl EtcdAuthority {
    /// Installs the seam before a group commit's removals go to etcd (tests).
    #[cfg(feature = "seams")]
    pub fn set_removal_gate(&self, gate: Option<super::RemovalGate>) {
        self.group.set_removal_gate(gate);
    }

    /// [`Authority::publish_many`]: each name published here first (write-once among this
    /// host's writers), then those in the shared pool in etcd, through the group commit.
    pub(super) fn publish_group(&self, items: &[Publishing<'_>]) -> Vec<Result<()>> {
        let mut out: Vec<Option<Result<()>>> = Vec::with_capacity(items.len());
        let mut shared = Vec::new();
        let mut asks = Vec::new();
        // Rejoining, or rejoined and not caught up with the entries yet, nothing of the
        // shared pool is published: a region claimed again may hold another host's entry
        // (that host took it, wrote and lost it while this one was cut off), which only that
        // read shows (`lose_occupied`), and bytes written there before the cut are not this
        // host's to publish.
        let catching_up = self.catching_up();
        for (i, p) in items.iter().enumerate() {
            if p.at.pool == Some(self.pool.as_str()) && catching_up {
                out.push(Some(Err(crate::store::authority::fenced_error())));
                continue;
            }
            if p.at.pool == Some(self.pool.as_str()) && self.in_lost_region(p.at.offset()) {
                out.push(Some(Err(Error::Busy(format!(
                    "{}/{}: its region was claimed by another host while this one was cut off",
                    p.ns, p.key
                )))));
                continue;
            }
            if let Err(e) = self.local.publish(p.ns, p.key, p.id, &p.at) {
                out.push(Some(Err(e)));
                continue;
            }
            if p.at.pool != Some(self.pool.as_str()) {
                out.push(Some(Ok(()))); // not the shared pool: this host's alone
                continue;
            }
            out.push(None);
            let name = (p.ns.to_owned(), p.key.to_owned());
            // From now on the other hosts' changes of the name wait for the store to settle it.
            self.changing.begin(p.ns, p.key);
            asks.push(Item {
                reserved: self.reserved.lock().contains(&name),
                ns: name.0,
                key: name.1,
                record: EntryRecord {
                    offset: p.at.offset(),
                    len: p.at.size,
                    node: self.node.clone(),
                    alloc: p.id,
                },
            });
            shared.push(i);
        }
        if !asks.is_empty() {
            let outcomes = self.group.publish(asks);
            for (i, outcome) in shared.into_iter().zip(outcomes) {
                out[i] = Some(self.published_outcome(&items[i], outcome));
            }
        }
        out.into_iter()
            .map(|o| o.expect("every publication has its outcome"))
            .collect()
    }

    /// What etcd answered to publication `p`, applied here: the name kept (and this host's
    /// reservation of it gone), or given back with the reason.
    fn published_outcome(
        &self,
        p: &Publishing<'_>,
        outcome: maru_cluster::Result<Published>,
    ) -> Result<()> {
        let name = (p.ns.to_owned(), p.key.to_owned());
        let refused = match outcome {
            Ok(Published::New { revision }) => {
                tracing::debug!(
                    ns = p.ns,
                    key = p.key,
                    offset = p.at.offset(),
                    len = p.at.size,
                    revision,
                    "published"
                );
                self.reserved.lock().remove(&name);
                self.published.lock().insert(name, entry_at(revision, p));
                return Ok(());
            }
            // This host's own record (a restart recovering what it published): followed as
            // a publication of this host's (a removal elsewhere frees its extent here, and a
            // read of every entry after a rejoin finds it gone if it went meanwhile).
            Ok(Published::Exists { record, created })
                if record.node == self.node && record.offset == p.at.offset() =>
            {
                self.published.lock().insert(name, entry_at(created, p));
                return Ok(());
            }
            Ok(taken) => taken_error(p.ns, p.key, &taken),
            Err(e @ maru_cluster::Error::LeaseLost(_)) => cluster_error(e),
            // Written into a region another host took while this one was cut off: those
            // bytes are not this host's to publish.
            Err(e @ maru_cluster::Error::NotClaimed { .. }) => Error::Busy(e.to_string()),
            // Refused at the connection: it never reached etcd.
            Err(e) if e.never_sent() => unavailable(e),
            Err(e) => match self.resolve(p) {
                // It made it: published, as etcd says.
                Some(Some(revision)) => {
                    self.reserved.lock().remove(&name);
                    self.published.lock().insert(name, entry_at(revision, p));
                    return Ok(());
                }
                Some(None) => unavailable(e),
                None => {
                    tracing::error!(
                        ns = p.ns,
                        key = p.key,
                        "publication failed ({e}) and etcd could not say whether it made it"
                    );
                    unavailable(e)
                }
            },
        };
        self.drop_reservation(p.ns, p.key);
        self.local.release(p.ns, p.key, p.id);
        self.changing.settle(p.ns, p.key);
        Err(refused)
    }

    /// Whether publication `p`, whose outcome etcd did not tell (its answer was lost), made
    /// it: first every publication of this host still on its way is fenced off (it could
    /// reach etcd later: the network may have queued it), then etcd is asked; again every
    /// quarter second for up to [`RESOLVE_FOR`], the client waiting (not the store).
    /// Some(revision) if it did, Some(None) if not, None if etcd did not answer. Failing it
    /// without knowing would free an extent that the other hosts may serve as the entry's.
    fn resolve(&self, p: &Publishing<'_>) -> Option<Option<i64>> {
        let rec = EntryRecord {
            offset: p.at.offset(),
            len: p.at.size,
            node: self.node.clone(),
            alloc: p.id,
        };
        let (m, ns, key) = (self.member(), p.ns.to_owned(), p.key.to_owned());
        self.run(async move {
            let deadline = tokio::time::Instant::now() + RESOLVE_FOR;
            loop {
                let m = m.read().await;
                // A lost lease fences them as well: each compares it.
                let fenced = match m.fence_publications().await {
                    Ok(()) | Err(maru_cluster::Error::LeaseLost(_)) => true,
                    Err(_) => false,
                };
                if fenced && let Ok(r) = m.published_as(&ns, &key, &rec).await {
                    return Some(r);
                }
                drop(m);
                if tokio::time::Instant::now() >= deadline {
                    return None;
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        })
    }

    /// The creation revision of this host's publication of `ns/key`, if it has one.
    fn published_at(&self, ns: &str, key: &str) -> Option<i64> {
        self.published
            .lock()
            .get(&(ns.to_owned(), key.to_owned()))
            .map(|e| e.created)
    }

    /// Removes this host's publication `ns/key` from etcd: only the record it published (a
    /// newer one of the name, another host's after a removal, stays).
    pub(super) fn remove_own(&self, ns: &str, key: &str) -> Result<maru_cluster::Removed> {
        let entry = self
            .published
            .lock()
            .get(&(ns.to_owned(), key.to_owned()))
            .copied();
        let r = self
            .group
            .remove(vec![Withdrawal {
                ns: ns.to_owned(),
                key: key.to_owned(),
                entry,
            }])
            .pop()
            .expect("one outcome");
        self.tombstones.store(true, Ordering::Release);
        r.map_err(unavailable)
    }

    /// [`Authority::withdraw`]: the removals of the entries in the shared pool that this host
    /// has published, through the group commit.
    pub(super) fn withdraw_group(
        &self,
        items: &[Publishing<'_>],
    ) -> Vec<Result<Option<Withdrawn>>> {
        let mut out: Vec<Result<Option<Withdrawn>>> = Vec::with_capacity(items.len());
        let (mut asked, mut names) = (Vec::new(), Vec::new());
        for (i, p) in items.iter().enumerate() {
            out.push(Ok(None));
            if p.at.pool == Some(self.pool.as_str())
                && self.local.holder(p.ns, p.key) == Some(Claim::Published(p.id))
            {
                asked.push(i);
                let name = (p.ns.to_owned(), p.key.to_owned());
                // The one this host knows: a removal etcd receives late takes no newer one.
                let created = self
                    .published_at(p.ns, p.key)
                    .or_else(|| self.remote.lock().get(&name).map(|&(_, c)| c));
                names.push(Withdrawal {
                    ns: name.0,
                    key: name.1,
                    entry: created.map(|created| EntryAt {
                        created,
                        offset: p.at.offset(),
                        len: p.at.size,
                    }),
                });
            }
        }
        if !names.is_empty() {
            let removed = self.group.remove(names);
            self.tombstones.store(true, Ordering::Release);
            for (i, r) in asked.into_iter().zip(removed) {
                out[i] = r
                    .map(|r| {
                        Some(Withdrawn {
                            revision: r.revision,
                            existed: r.existed,
                        })
                    })
                    .map_err(unavailable);
            }
        }
        out
    }
}

/// Publication `p`, created at `revision`: the entry this host follows as its own.
fn entry_at(revision: i64, p: &Publishing<'_>) -> EntryAt {
    EntryAt {
        created: revision,
        offset: p.at.offset(),
        len: p.at.size,
    }
}

impl EtcdAuthority {
    /// [`Authority::reserve_everywhere`](crate::store::authority::Authority::reserve_everywhere)
    /// for the shared pool: the name reserved in etcd for this host's writer `id`.
    pub(super) fn reserve_shared(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        let name = (ns.to_owned(), key.to_owned());
        if self.reservations.unreserving.lock().contains(&name) {
            self.local.release(ns, key, id);
            return Err(Error::Busy(format!(
                "{ns}/{key}: this host is giving back an earlier reservation of the name; retry"
            )));
        }
        if self.reserved.lock().contains(&name) {
            self.changing.begin(ns, key);
            return Ok(());
        }
        // From now on the other hosts' changes of the name wait for the store to settle it:
        // one the watch brings late (a put before this reservation) would otherwise be filed
        // over the name this host's writer holds, and refuse its publication (seed 1149).
        self.changing.begin(ns, key);
        let (m, n, k) = (self.member(), ns.to_owned(), key.to_owned());
        let r = self.run(async move { m.read().await.reserve(&n, &k).await });
        let e = match self.reservations.heard(r) {
            Ok(None) => {
                self.reserved.lock().insert(name);
                return Ok(());
            }
            Ok(Some(taken)) => taken_error(ns, key, &taken),
            Err(e) => {
                if matches!(e, maru_cluster::Error::Etcd(_)) && !e.never_sent() {
                    // It may have landed all the same.
                    self.give_back_reservation(name, true);
                }
                cluster_error(e)
            }
        };
        self.local.release(ns, key, id);
        self.changing.settle(ns, key);
        Err(e)
    }

    /// Gives back this host's reservation of `ns/key` in etcd, if it has one (in the
    /// background: a late one only keeps the name a moment longer).
    pub(super) fn drop_reservation(&self, ns: &str, key: &str) {
        let name = (ns.to_owned(), key.to_owned());
        if self.reserved.lock().remove(&name) {
            self.give_back_reservation(name, false);
        }
    }

    /// Gives back the reservation of `name` that etcd may hold for this host (`unsure`: a
    /// request that made it may still be on its way), in the background, until etcd has
    /// answered or the lease it was bound to is gone.
    pub(super) fn give_back_reservation(&self, name: Name, unsure: bool) {
        if !self.reservations.unreserving.lock().insert(name.clone()) {
            return; // on its way already
        }
        let (m, reservations) = (self.member(), self.reservations.clone());
        self.rt.spawn(async move {
            let lease = m.read().await.lease();
            let mut unsure = unsure;
            for attempt in 0u32.. {
                if attempt > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                let m = m.read().await;
                if m.lease() != lease {
                    break; // gone with the lease
                }
                let r = if unsure {
                    m.fence_publications().await
                } else {
                    Ok(())
                };
                match r.and(m.unreserve(&name.0, &name.1).await) {
                    Ok(()) | Err(maru_cluster::Error::LeaseLost(_)) => break,
                    Err(e) => {
                        // The give-back itself may land later: fenced before the next.
                        unsure = true;
                        if attempt == 0 {
                            tracing::warn!(
                                ns = %name.0,
                                key = %name.1,
                                "giving a reservation back: {e}; trying again until etcd takes it"
                            );
                        }
                    }
                }
            }
            reservations.unreserving.lock().remove(&name);
        });
    }

    /// Whether a reservation of `ns/key` is being given back here (tests; feature `seams`).
    #[cfg(feature = "seams")]
    pub fn unreserving(&self, ns: &str, key: &str) -> bool {
        let name = (ns.to_owned(), key.to_owned());
        self.reservations.unreserving.lock().contains(&name)
    }

    /// The next `n` answers of etcd to this host's reservations are lost: the reservation is
    /// made, and this host hears an error (tests; feature `seams`).
    #[cfg(feature = "seams")]
    pub fn lose_reservation_answers(&self, n: usize) {
        use std::sync::atomic::Ordering;
        self.reservations.lose.store(n, Ordering::Release);
    }
}
