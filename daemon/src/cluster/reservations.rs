//! The names this host reserves in etcd for its mount's writers, and giving them back.
//!
//! A reservation keeps a name from every other host until the writer publishes it or lets
//! go. One that etcd may hold without this host knowing (its answer was lost, or a give-back
//! failed) would keep the name for as long as this host's lease lives, which for a healthy
//! host is for ever: no host could store the name again. So such a reservation is given back
//! in the background until etcd confirms it, after a fence (`fence_publications`) whenever a
//! request about it may still be on its way, so that none lands after; meanwhile a new
//! reservation of the name here is refused for a moment (`EBUSY`).

use std::collections::HashSet;
use std::time::Duration;

use maru::{Error, Result};
use parking_lot::Mutex;

use super::{EtcdAuthority, Name, cluster_error, taken_error};
use crate::store::authority::Authority;

/// Names whose reservation in etcd this host is giving back.
#[derive(Default)]
pub(super) struct Reservations {
    unreserving: Mutex<HashSet<Name>>,
    /// Answers of etcd to reservations that the next ones lose (tests; feature `seams`).
    #[cfg(feature = "seams")]
    lose: std::sync::atomic::AtomicUsize,
}

impl Reservations {
    /// What etcd answered a reservation, as this host hears it: lost, in a test that asked
    /// for it ([`EtcdAuthority::lose_reservation_answers`]).
    fn heard<T>(&self, r: maru_cluster::Result<T>) -> maru_cluster::Result<T> {
        #[cfg(feature = "seams")]
        {
            use std::sync::atomic::Ordering;
            let lose = |n: usize| n.checked_sub(1);
            if r.is_ok()
                && self
                    .lose
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, lose)
                    .is_ok()
            {
                return Err(maru_cluster::etcd::Error::StreamEnded.into());
            }
        }
        r
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
                    tokio::time::sleep(Duration::from_millis(500)).await;
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
