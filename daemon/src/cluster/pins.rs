//! The pins of the cluster as this host knows them, each with the etcd revision of the
//! change it knows of.
//!
//! Three sources change them, and they do not arrive in revision order: this host's own
//! pins and unpins (known when etcd answers), the pins' watch (every change, in order), and
//! a read of every pin after a (re)start of that watch, which can be older than a pin this
//! host made while the read was on its way. A change older than the one known for a name
//! is passed by, so a late read never takes back a pin (or an unpin) made after it.

use std::collections::HashMap;

use super::Name;

/// Every name pinned or unpinned lately, with the revision of its last change.
#[derive(Debug, Default)]
pub(super) struct Pins {
    known: HashMap<Name, Change>,
    /// The revision of the last read of every pin: what it covers of a name it does not
    /// name is known (not pinned then).
    read_at: i64,
}

/// A name's last known change.
#[derive(Debug, Clone, Copy)]
struct Change {
    pinned: bool,
    revision: i64,
}

impl Pins {
    /// Whether `name` is pinned.
    pub(super) fn pinned(&self, name: &Name) -> bool {
        self.known.get(name).is_some_and(|c| c.pinned)
    }

    /// A pin (or unpin) of `name` made at `revision`, by this host or seen on the watch:
    /// true if it is the newest known (the store is to apply it), false if a later change
    /// of the name is known already.
    pub(super) fn change(&mut self, name: Name, pinned: bool, revision: i64) -> bool {
        let known = self.known.get(&name).map_or(self.read_at, |c| c.revision);
        let newer = known < revision;
        if newer {
            self.known.insert(name, Change { pinned, revision });
        }
        newer
    }

    /// Every pinned name, read at `revision`: the changes the store is to apply, as (name,
    /// pinned). A name changed after `revision` keeps its later state; unpinned names the
    /// read covers are forgotten.
    pub(super) fn all(&mut self, pinned: Vec<Name>, revision: i64) -> Vec<(Name, bool)> {
        let mut out = Vec::new();
        for name in pinned {
            if self.change(name.clone(), true, revision) {
                out.push((name, true));
            }
        }
        for (name, c) in &mut self.known {
            if c.revision < revision && c.pinned {
                // Pinned before the read, absent from it: unpinned since (or its entry gone).
                c.pinned = false;
                c.revision = revision;
                out.push((name.clone(), false));
            }
        }
        self.known.retain(|_, c| c.pinned || c.revision > revision);
        self.read_at = self.read_at.max(revision);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(key: &str) -> Name {
        ("ns".to_owned(), key.to_owned())
    }

    #[test]
    fn a_read_older_than_a_pin_made_here_does_not_take_it_back() {
        let mut p = Pins::default();
        assert!(p.change(n("k1"), true, 20), "pinned here at 20");
        // The read at 15 started before the pin and arrives after it.
        assert_eq!(p.all(vec![n("k0")], 15), [(n("k0"), true)]);
        assert!(p.pinned(&n("k1")) && p.pinned(&n("k0")));
        // The watch, from 16, brings the pin again: nothing new.
        assert!(!p.change(n("k1"), true, 20));
    }

    #[test]
    fn a_read_older_than_an_unpin_made_here_does_not_pin_again() {
        let mut p = Pins::default();
        assert_eq!(p.all(vec![n("k1")], 10), [(n("k1"), true)]);
        assert!(p.change(n("k1"), false, 20), "unpinned here at 20");
        assert!(p.all(vec![n("k1")], 15).is_empty());
        assert!(!p.pinned(&n("k1")));
    }

    #[test]
    fn a_newer_read_settles_what_it_covers() {
        let mut p = Pins::default();
        assert!(p.change(n("k1"), true, 20));
        assert!(p.change(n("k2"), true, 21));
        assert!(p.change(n("k3"), false, 22));
        // At 30, k1 is pinned still, k2 was unpinned (or its entry removed), k4 pinned.
        let mut out = p.all(vec![n("k1"), n("k4")], 30);
        out.sort();
        assert_eq!(out, [(n("k1"), true), (n("k2"), false), (n("k4"), true)]);
        assert!(p.pinned(&n("k1")) && !p.pinned(&n("k2")) && p.pinned(&n("k4")));
        assert_eq!(p.known.len(), 2, "what the read unpinned is forgotten");
        // A watch event older than the read is passed by.
        assert!(!p.change(n("k2"), true, 25));
        assert!(p.change(n("k2"), true, 31));
    }
}
