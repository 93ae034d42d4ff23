//! Least-recently-used order of sealed entries.
//!
//! A use only stamps the entry with the store's clock (one hash lookup under the store's
//! lock, on the hot path of every retrieval); the order itself, a tree keyed by the clock, is
//! settled when eviction walks it: entries used since they were filed are re-filed first, so
//! eviction still takes exact LRU order.

use std::collections::BTreeMap;

use super::hashmap::HashMap;

/// An entry's place in the order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stamp {
    /// Last use (the clock).
    pub used: u64,
    /// The key it is filed under in the tree: `used` when it was last filed.
    pub filed: u64,
}

/// The order: clock value → inode.
#[derive(Debug, Default)]
pub struct Lru {
    clock: u64,
    tree: BTreeMap<u64, u64>,
}

impl Lru {
    /// Files a new entry as the most recently used; returns its stamp.
    pub fn file(&mut self, ino: u64) -> Stamp {
        self.clock += 1;
        self.tree.insert(self.clock, ino);
        Stamp {
            used: self.clock,
            filed: self.clock,
        }
    }

    /// Marks a use of the entry stamped `s` (its place is settled later).
    pub fn touch(&mut self, s: &mut Stamp) {
        self.clock += 1;
        s.used = self.clock;
    }

    /// Removes the entry stamped `s`.
    pub fn remove(&mut self, s: &Stamp) {
        self.tree.remove(&s.filed);
    }

    /// Re-files every entry used since it was filed (`stamps` gives each inode's stamp), so
    /// that the tree's order is the order of last use again.
    pub fn settle(&mut self, stamps: &mut HashMap<u64, impl AsMut<Stamp>>) {
        let stale: Vec<(u64, u64)> = self
            .tree
            .iter()
            .filter(|(k, ino)| stamps.get_mut(ino).is_some_and(|s| s.as_mut().used != **k))
            .map(|(k, ino)| (*k, *ino))
            .collect();
        for (k, ino) in stale {
            self.tree.remove(&k);
            if let Some(s) = stamps.get_mut(&ino) {
                let s = s.as_mut();
                s.filed = s.used;
                self.tree.insert(s.used, ino);
            }
        }
    }

    /// Inodes from least to most recently used (as filed: settle first).
    pub fn oldest_first(&self) -> impl Iterator<Item = u64> + '_ {
        self.tree.values().copied()
    }

    /// Number of entries filed.
    pub fn len(&self) -> usize {
        self.tree.len()
    }

    /// The inode filed under `key`.
    pub fn filed_under(&self, key: u64) -> Option<u64> {
        self.tree.get(&key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct S(Stamp);
    impl AsMut<Stamp> for S {
        fn as_mut(&mut self) -> &mut Stamp {
            &mut self.0
        }
    }

    fn order(l: &Lru) -> Vec<u64> {
        l.oldest_first().collect()
    }

    #[test]
    fn uses_reorder_only_when_settled() {
        let mut l = Lru::default();
        let mut m: HashMap<u64, S> = (1..=4).map(|i| (i, S(l.file(i)))).collect();
        assert_eq!(order(&l), [1, 2, 3, 4]);
        l.touch(&mut m.get_mut(&1).unwrap().0);
        l.touch(&mut m.get_mut(&3).unwrap().0);
        l.touch(&mut m.get_mut(&1).unwrap().0);
        // Not settled: the tree still has the filing order.
        assert_eq!(order(&l), [1, 2, 3, 4]);
        l.settle(&mut m);
        assert_eq!(order(&l), [2, 4, 3, 1]);
        for (ino, s) in &m {
            assert_eq!(s.0.filed, s.0.used);
            assert_eq!(l.filed_under(s.0.filed), Some(*ino));
        }
    }

    #[test]
    fn removal_forgets_the_entry_whether_or_not_settled() {
        let mut l = Lru::default();
        let mut m: HashMap<u64, S> = (1..=3).map(|i| (i, S(l.file(i)))).collect();
        l.touch(&mut m.get_mut(&2).unwrap().0);
        let s = m.remove(&2).unwrap();
        l.remove(&s.0);
        l.settle(&mut m);
        assert_eq!(order(&l), [1, 3]);
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn new_entries_are_the_most_recent() {
        let mut l = Lru::default();
        let mut m: HashMap<u64, S> = HashMap::default();
        m.insert(1, S(l.file(1)));
        l.touch(&mut m.get_mut(&1).unwrap().0);
        m.insert(2, S(l.file(2)));
        l.settle(&mut m);
        assert_eq!(order(&l), [1, 2]);
    }
}
