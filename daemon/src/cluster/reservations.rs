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

use parking_lot::Mutex;

/// Names whose reservation in etcd this host is giving back.
#[derive(Default)]
pub(super) struct Reservations {
    pub(super) unreserving: Mutex<HashSet<(String, String)>>,
    /// Answers of etcd to reservations that the next ones lose (tests; feature `seams`).
    #[cfg(feature = "seams")]
    pub(super) lose: std::sync::atomic::AtomicUsize,
}

impl Reservations {
    /// What etcd answered a reservation, as this host hears it: lost, in a test that asked
    /// for it (`EtcdAuthority::lose_reservation_answers`).
    pub(super) fn heard<T>(&self, r: maru_cluster::Result<T>) -> maru_cluster::Result<T> {
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
