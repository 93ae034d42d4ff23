//! Records every host follows (the pins, the quotas) as this host knows them, each with
//! the etcd revision of the change it knows of.
//!
//! Three sources change them, and they do not arrive in revision order: this host's own
//! changes (known when etcd answers), the watch (every change, in order), and a read of
//! every record after a (re)start of that watch, which can be older than a change this
//! host made while the read was on its way. A change older than the one known for a name
//! is passed by, so a late read never takes back a change made after it. What the read and
//! the watch after it have brought is complete up to a revision: a name cleared before it
//! needs no record (a change of it as old is passed by all the same), so the records of
//! cleared names do not pile up.

use std::collections::HashMap;
use std::hash::Hash;

/// Every record set or cleared lately, by name, with the revision of its last change.
#[derive(Debug)]
pub(super) struct Known<K, V> {
    /// A name's value (None: cleared) and the revision it was set or cleared at.
    known: HashMap<K, (Option<V>, i64)>,
    /// Every change up to this revision is known (from the last read of every record and
    /// the watch after it): a name without a record was not set then.
    complete_to: i64,
    /// Records of cleared names.
    cleared: usize,
}

impl<K, V> Default for Known<K, V> {
    fn default() -> Self {
        Self {
            known: HashMap::new(),
            complete_to: 0,
            cleared: 0,
        }
    }
}

impl<K: Clone + Eq + Hash, V: Clone> Known<K, V> {
    /// Record `name`'s value, if set.
    pub(super) fn get(&self, name: &K) -> Option<&V> {
        self.state(name).flatten()
    }

    /// Record `name`'s value (None: cleared), if a change of it is known lately.
    pub(super) fn state(&self, name: &K) -> Option<Option<&V>> {
        self.known.get(name).map(|c| c.0.as_ref())
    }

    /// Record `name` set to `value` (None: cleared) at `revision`, by this host: true if it
    /// is the newest known (the store is to apply it), false if a later change of the name
    /// is known already.
    pub(super) fn change(&mut self, name: K, value: Option<V>, revision: i64) -> bool {
        let known = self.known.get(&name).map_or(self.complete_to, |c| c.1);
        let newer = known < revision;
        if newer {
            let was_cleared = self.known.get(&name).is_some_and(|c| c.0.is_none());
            self.cleared = self.cleared + usize::from(value.is_none()) - usize::from(was_cleared);
            self.known.insert(name, (value, revision));
        }
        newer
    }

    /// As [`Known::change`], for a change the watch brought: every change before its
    /// revision is known now.
    pub(super) fn seen(&mut self, name: K, value: Option<V>, revision: i64) -> bool {
        let newer = self.change(name, value, revision);
        self.complete_to = self.complete_to.max(revision - 1);
        if self.cleared > 1024 && self.cleared > self.known.len() / 2 {
            self.forget_cleared();
        }
        newer
    }

    /// Drops the records of names cleared before the revision every change is known up to.
    fn forget_cleared(&mut self) {
        let to = self.complete_to;
        self.known.retain(|_, c| c.0.is_some() || c.1 > to);
        self.cleared = self.known.values().filter(|c| c.0.is_none()).count();
    }

    /// Every record set, read at `revision`: the changes the store is to apply. A name
    /// changed after `revision` keeps its later value; cleared names the read covers are
    /// forgotten.
    pub(super) fn all(&mut self, set: Vec<(K, V)>, revision: i64) -> Vec<(K, Option<V>)> {
        let mut out = Vec::new();
        for (name, value) in set {
            if self.change(name.clone(), Some(value.clone()), revision) {
                out.push((name, Some(value)));
            }
        }
        for (name, c) in &mut self.known {
            if c.1 < revision && c.0.is_some() {
                // Set before the read, absent from it: cleared since (or its entry gone).
                *c = (None, revision);
                out.push((name.clone(), None));
            }
        }
        self.complete_to = self.complete_to.max(revision);
        self.forget_cleared();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(key: &str) -> String {
        key.to_owned()
    }

    #[test]
    fn a_read_older_than_a_change_made_here_does_not_take_it_back() {
        let mut p = Known::<String, u64>::default();
        assert!(p.change(n("k1"), Some(1), 20), "set here at 20");
        // The read at 15 started before the change and arrives after it.
        assert_eq!(p.all(vec![(n("k0"), 7)], 15), [(n("k0"), Some(7))]);
        assert_eq!((p.get(&n("k1")), p.get(&n("k0"))), (Some(&1), Some(&7)));
        // The watch, from 16, brings the change again: nothing new.
        assert!(!p.change(n("k1"), Some(1), 20));
    }

    #[test]
    fn a_read_older_than_a_clear_made_here_does_not_set_again() {
        let mut p = Known::<String, u64>::default();
        assert_eq!(p.all(vec![(n("k1"), 1)], 10), [(n("k1"), Some(1))]);
        assert!(p.change(n("k1"), None, 20), "cleared here at 20");
        assert!(p.all(vec![(n("k1"), 1)], 15).is_empty());
        assert_eq!(p.get(&n("k1")), None);
    }

    #[test]
    fn the_watch_keeps_no_record_of_what_it_cleared_long_ago() {
        let mut p = Known::<String, u64>::default();
        assert!(p.all(Vec::new(), 10).is_empty());
        for i in 0..5000 {
            assert!(p.seen(format!("k{i}"), Some(1), 11 + 2 * i));
            assert!(p.seen(format!("k{i}"), None, 12 + 2 * i));
        }
        assert!(p.known.len() < 2100, "{} records", p.known.len());
        // An answer to this host's own pin of k0, older than what the watch brought: passed by.
        assert!(!p.change(n("k0"), Some(1), 11));
        assert_eq!(p.state(&n("k0")), None);
        // One newer than everything: taken.
        assert!(p.change(n("k0"), Some(2), 20_000));
        assert_eq!(p.get(&n("k0")), Some(&2));
    }

    #[test]
    fn a_newer_read_settles_what_it_covers() {
        let mut p = Known::<String, u64>::default();
        assert!(p.change(n("k1"), Some(1), 20));
        assert!(p.change(n("k2"), Some(2), 21));
        assert!(p.change(n("k3"), None, 22));
        // At 30, k1 is set still (to 5 now), k2 was cleared (or its entry removed), k4 set.
        let mut out = p.all(vec![(n("k1"), 5), (n("k4"), 4)], 30);
        out.sort();
        assert_eq!(
            out,
            [(n("k1"), Some(5)), (n("k2"), None), (n("k4"), Some(4))]
        );
        assert_eq!(p.known.len(), 2, "what the read cleared is forgotten");
        assert_eq!(
            (p.state(&n("k2")), p.state(&n("k1"))),
            (None, Some(Some(&5)))
        );
        // A change older than the read is passed by, even of a name forgotten.
        assert!(!p.change(n("k2"), Some(2), 25));
        assert_eq!(p.get(&n("k2")), None);
        assert!(p.change(n("k2"), Some(3), 31));
        assert_eq!(p.get(&n("k2")), Some(&3));
    }
}
