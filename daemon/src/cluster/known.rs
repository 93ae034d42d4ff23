//! Records every host follows (the pins, the quotas) as this host knows them, each with
//! the etcd revision of the change it knows of.
//!
//! Three sources change them, and they do not arrive in revision order: this host's own
//! changes (known when etcd answers), the watch (every change, in order), and a read of
//! every record after a (re)start of that watch, which can be older than a change this
//! host made while the read was on its way. A change older than the one known for a name
//! is passed by, so a late read never takes back a change made after it.

use std::collections::HashMap;
use std::hash::Hash;

/// Every record set or cleared lately, by name, with the revision of its last change.
#[derive(Debug)]
pub(super) struct Known<K, V> {
    /// A name's value (None: cleared) and the revision it was set or cleared at.
    known: HashMap<K, (Option<V>, i64)>,
    /// The revision of the last read of every record: what it covers of a name it does not
    /// name is known (not set then).
    read_at: i64,
}

impl<K, V> Default for Known<K, V> {
    fn default() -> Self {
        Self {
            known: HashMap::new(),
            read_at: 0,
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

    /// Record `name` set to `value` (None: cleared) at `revision`, by this host or seen on
    /// the watch: true if it is the newest known (the store is to apply it), false if a
    /// later change of the name is known already.
    pub(super) fn change(&mut self, name: K, value: Option<V>, revision: i64) -> bool {
        let known = self.known.get(&name).map_or(self.read_at, |c| c.1);
        let newer = known < revision;
        if newer {
            self.known.insert(name, (value, revision));
        }
        newer
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
        self.known.retain(|_, c| c.0.is_some() || c.1 > revision);
        self.read_at = self.read_at.max(revision);
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
