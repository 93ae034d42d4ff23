//! Orphans: the entries of a publisher gone for good.
//!
//! Only an entry's publisher evicts it, so a host that leaves the cluster for good (its
//! lease ran out and it never came back: decommissioned, its disk lost) would leave its
//! entries in the shared pool until a client deleted them by name, while every other host
//! made room by evicting its own entries only, however recently used. Each host notes from
//! the hosts' records (read every second) since when each publisher of the entries it serves
//! has been gone; once that is longer than `--cluster-orphans-after`, its eviction may take
//! them as the publisher's would, in its own order of use, by removing them at etcd as a
//! delete here does. A publisher that comes back later finds them removed, as after a
//! delete made while it was down.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Since when each publisher this host serves entries of has been seen gone.
#[derive(Debug)]
pub(super) struct Orphans {
    /// How long a publisher stays gone before its entries are orphans.
    after: Duration,
    gone_since: Mutex<HashMap<String, Instant>>,
}

impl Orphans {
    pub(super) fn new(after: Duration) -> Orphans {
        Orphans {
            after,
            gone_since: Mutex::new(HashMap::new()),
        }
    }

    /// A read of the hosts' records at `now` found `live`; `publishers` are those of the
    /// entries this host serves.
    pub(super) fn seen<'a>(
        &self,
        live: &HashSet<&str>,
        publishers: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) {
        let gone: HashSet<&str> = publishers
            .into_iter()
            .filter(|p| !live.contains(p))
            .collect();
        let mut since = self.gone_since.lock();
        since.retain(|p, _| gone.contains(p.as_str()));
        for p in gone {
            since.entry(p.to_owned()).or_insert(now);
        }
    }

    /// Whether any publisher has been seen gone for longer than the configured while, by
    /// `now` (eviction looks no further, most of the time).
    pub(super) fn any(&self, now: Instant) -> bool {
        self.gone_since
            .lock()
            .values()
            .any(|t| now.saturating_duration_since(*t) >= self.after)
    }

    /// Whether `publisher` has been seen gone for longer than the configured while, by `now`.
    pub(super) fn orphaned(&self, publisher: &str, now: Instant) -> bool {
        self.gone_since
            .lock()
            .get(publisher)
            .is_some_and(|t| now.saturating_duration_since(*t) >= self.after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publisher_is_orphaned_once_gone_long_enough_and_no_more_once_back() {
        let o = Orphans::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let live: HashSet<&str> = ["a"].into();
        o.seen(&live, ["a", "b"], t0);
        assert!(!o.orphaned("a", t0 + Duration::from_secs(600)));
        assert!(!o.orphaned("b", t0 + Duration::from_secs(59)));
        assert!(!o.any(t0 + Duration::from_secs(59)));
        // Seen gone again later: the first sighting counts.
        o.seen(&live, ["b"], t0 + Duration::from_secs(30));
        assert!(o.orphaned("b", t0 + Duration::from_secs(60)));
        assert!(o.any(t0 + Duration::from_secs(60)));
        // Back: no longer, and gone again it waits the whole while afresh.
        let both: HashSet<&str> = ["a", "b"].into();
        o.seen(&both, ["a", "b"], t0 + Duration::from_secs(61));
        assert!(!o.orphaned("b", t0 + Duration::from_secs(62)));
        o.seen(&live, ["b"], t0 + Duration::from_secs(62));
        assert!(!o.orphaned("b", t0 + Duration::from_secs(100)));
        assert!(o.orphaned("b", t0 + Duration::from_secs(122)));
        // No entry of it served here any more: forgotten.
        o.seen(&live, ["a"], t0 + Duration::from_secs(130));
        assert!(!o.orphaned("b", t0 + Duration::from_secs(200)));
        assert!(!o.any(t0 + Duration::from_secs(200)));
    }
}
