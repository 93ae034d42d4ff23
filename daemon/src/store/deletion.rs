//! Deletes and pins: the authority is asked with the store's lock released.
//!
//! A client's delete (and an unlink through the mount) takes three steps. Under the lock, each key's entry is found and the
//! policy asked; an entry of a raw pool shared with other hosts is marked as being withdrawn
//! (not evicted, renamed or deleted again meanwhile). Without the lock, the authority records
//! the removals (in cluster mode one group commit with whatever else waits for etcd). Under
//! the lock again, each entry whose removal was recorded is removed here; one whose removal
//! failed stays, unmarked, and its key fails with the reason. On a single host, and for
//! entries only this host sees, the three steps are one, under the lock.
//!
//! Pins take the same three steps, one pin verb at a time (`Store::pins`), so that an
//! entry's pin here ends as the authority last recorded it.

use super::locked::Locked;
use maru::name::split_ns;
use maru::{Error, Result};
use maru_fsd::Caller;

use super::authority::{Placed, Publishing, Withdrawn};
use super::entries::Entry;
use super::entries::Removal;
use super::ids::Place;
use super::policy::Access;
use super::state::State;
use super::{Invalidation, Store};

/// An entry a delete, a pin or an eviction found, between its steps.
pub(super) struct Found {
    ino: u64,
    ns: String,
    key: String,
    /// The raw pool's UUID (None: a memfs pool's entry) and where the entry is in it.
    pool: Option<String>,
    place: Place,
    size: u64,
}

impl Found {
    /// Sealed entry `ino` of `ns`, unless a delete is recording its removal already.
    fn unless_withdrawing(st: &State, ns: &str, ino: u64) -> Result<Found> {
        let e = &st.entries[&ino];
        if e.withdrawing() {
            return Err(Error::NotFound(format!("{ns}/{} (being deleted)", e.key())));
        }
        Ok(Found::of(st, e))
    }

    pub(super) fn of(st: &State, e: &Entry) -> Found {
        let at = st.placed(e);
        Found {
            ino: e.ino(),
            ns: e.ns().to_owned(),
            key: e.key().to_owned(),
            pool: at.pool.map(str::to_owned),
            place: at.place,
            size: at.size,
        }
    }

    fn placed(&self) -> Placed<'_> {
        Placed {
            pool: self.pool.as_deref(),
            place: self.place,
            size: self.size,
        }
    }
}

impl Store {
    /// Deletes entries; one outcome per key.
    pub fn delete(&self, c: &Caller, ns: &str, keys: &[String]) -> Result<Vec<Result<()>>> {
        split_ns(ns)?;
        let mut st = self.lock();
        self.wait_imminent(&mut st, ns, keys);
        let mut found: Vec<Found> = Vec::new();
        let mut out = Self::each_entry(
            &mut st,
            c,
            ns,
            keys,
            |p| Access::Delete(p),
            |st, ino| {
                found.push(Found::unless_withdrawing(st, ns, ino)?);
                Ok(())
            },
        )?;
        let (removed, inv) = self.remove_found(&mut st, &found, false);
        let mut removed = removed.into_iter();
        for r in out.iter_mut().filter(|r| r.is_ok()) {
            *r = removed.next().expect("one outcome per entry found");
        }
        drop(st);
        self.notify(inv);
        Ok(out)
    }

    /// Removes sealed entry `ino` of `ns` (an unlink through the mount), in a delete's
    /// steps; returns the name the kernel must forget. The lock is let go of, as
    /// [`Store::delete`] does, while the authority records the removal.
    pub(super) fn delete_entry(
        &self,
        st: &mut Locked<'_>,
        ns: &str,
        ino: u64,
    ) -> Result<Option<Invalidation>> {
        let found = [Found::unless_withdrawing(st, ns, ino)?];
        let (removed, inv) = self.remove_found(st, &found, false);
        removed.into_iter().next().expect("one outcome")?;
        Ok(inv.into_iter().next())
    }

    /// The last two steps of a delete (or, `evicted`, an eviction): the removals of the
    /// entries `found` recorded by the authority (without the lock when it is shared and one
    /// of them is in a shared pool), then each entry removed here; one outcome per entry,
    /// and the names to forget.
    pub(super) fn remove_found(
        &self,
        st: &mut Locked<'_>,
        found: &[Found],
        evicted: bool,
    ) -> (Vec<Result<()>>, Vec<Invalidation>) {
        let shared = self.authority.shared() && found.iter().any(|f| f.pool.is_some());
        let withdrawn: Vec<Result<Option<Withdrawn>>> = if shared {
            for f in found {
                st.entries
                    .get_mut(&f.ino)
                    .expect("found")
                    .set_withdrawing(true);
                self.authority.withdrawing(&f.ns, &f.key);
            }
            let asks = asks(found);
            let w = st.unlocked(|| {
                let w = self.authority.withdraw(&asks);
                for (a, _) in asks.iter().zip(&w).filter(|(_, w)| w.is_ok()) {
                    self.ask_gate("withdrawn", a.ns, a.key);
                }
                w
            });
            for f in found {
                if let Some(e) = st.entries.get_mut(&f.ino) {
                    e.set_withdrawing(false);
                }
            }
            w
        } else {
            found.iter().map(|_| Ok(None)).collect()
        };
        let mut inv = Vec::new();
        let removed = found
            .iter()
            .zip(withdrawn)
            .map(|(f, w)| {
                let how = match w? {
                    Some(w) => Removal::Withdrawn { w, evicted },
                    None if evicted => Removal::Evicted,
                    None => Removal::Deleted,
                };
                remove(st, self, f, how, &mut inv)
            })
            .collect();
        for f in found {
            self.authority.settled(&f.ns, &f.key);
        }
        (removed, inv)
    }

    /// Pins or unpins entries; one outcome per key. The authority records each change first
    /// (for every host sharing it), without the store's lock.
    pub fn pin(
        &self,
        c: &Caller,
        ns: &str,
        keys: &[String],
        pinned: bool,
    ) -> Result<Vec<Result<()>>> {
        split_ns(ns)?;
        let _one_at_a_time = self.pins.lock();
        let mut st = self.lock();
        self.wait_imminent(&mut st, ns, keys);
        let mut found: Vec<Option<Found>> = Vec::new();
        let mut out = Self::each_entry(
            &mut st,
            c,
            ns,
            keys,
            |p| Access::Pin(p),
            |st, ino| {
                let e = &st.entries[&ino];
                // Nothing to change: nothing to ask.
                found.push((e.pinned() != pinned).then(|| Found::of(st, e)));
                Ok(())
            },
        )?;
        let asked: Vec<Result<()>> = st.unlocked(|| {
            found
                .iter()
                .map(|f| match f {
                    Some(f) => self.authority.pin(ns, &f.key, pinned, &f.placed()),
                    None => Ok(()),
                })
                .collect()
        });
        let mut marked = found.iter().zip(asked).map(|(f, r)| {
            r?;
            match f {
                Some(f) if st.entries.get(&f.ino).is_some_and(|e| e.key() == f.key) => {
                    // Another host's later change of the pin may have come first: it stands.
                    let now = self.authority.pinned(ns, &f.key).unwrap_or(pinned);
                    st.mark_pinned(f.ino, now)
                }
                Some(f) => Err(Error::NotFound(format!("{ns}/{}", f.key))),
                None => Ok(()),
            }
        });
        for r in out.iter_mut().filter(|r| r.is_ok()) {
            *r = marked.next().expect("one outcome per entry found");
        }
        Ok(out)
    }
}

/// The removals to record of the entries `found`.
fn asks(found: &[Found]) -> Vec<Publishing<'_>> {
    found
        .iter()
        .map(|f| Publishing {
            ns: &f.ns,
            key: &f.key,
            id: f.ino,
            at: f.placed(),
        })
        .collect()
}

/// Removes entry `f` here (`how`), if it is still there under its name. Of two deletes of
/// one entry at once (on this host or two), the one whose removal found the entry at the
/// authority succeeds; the other says it is not found, and removes it here if it is still
/// there. An entry already gone here (the removal came back through the cluster's watch
/// first) was deleted all the same.
fn remove(
    st: &mut State,
    store: &Store,
    f: &Found,
    how: Removal,
    inv: &mut Vec<Invalidation>,
) -> Result<()> {
    let first = match how {
        Removal::Withdrawn { w, .. } => w.existed,
        _ => true,
    };
    let here = st.entries.get(&f.ino).is_some_and(|e| e.key() == f.key);
    if here {
        inv.extend(st.remove_entry(&*store.authority, &store.counters, f.ino, how)?);
    }
    if first {
        Ok(())
    } else {
        Err(Error::NotFound(format!("{}/{}", f.ns, f.key)))
    }
}
