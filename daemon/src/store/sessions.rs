//! Client sessions (one per control connection), their leases and their holds.

use std::time::{Duration, Instant};

use maru::name::split_ns;
use maru::{Error, Result};
use maru_fsd::Caller;

use super::SessionId;
use super::Store;
use super::locked::Locked;
use super::policy::Access;
use super::state::{Session, State};

/// The longest a hold waits for another client's first hold of the same entry to be
/// recorded (etcd's patience is 5 s).
const PIN_WAIT: Duration = Duration::from_secs(30);

impl Store {
    /// Registers a client connection.
    pub fn open_session(&self, name: &str, caller: Caller) -> SessionId {
        let mut st = self.lock();
        let id = st.next_session.max(SessionId::MOUNT.next());
        st.next_session = id.next();
        st.sessions.insert(
            id,
            Session {
                name: name.to_owned(),
                caller: Some(caller),
                ..Default::default()
            },
        );
        id
    }

    /// Takes (`hold`) or gives back one hold of `session` per key; one outcome per key. A hold
    /// needs what a retrieval needs (whoever may read an entry may keep it from eviction while
    /// its session lives); giving one back needs only to find the entry, and fails with
    /// [`Error::NotFound`] when the session holds none on it.
    ///
    /// The first hold here of another host's entry is recorded at the authority for its
    /// publisher, which alone evicts it; with the store's lock let go of (a round trip to
    /// etcd), while other holds of the entry wait for the outcome: none counts on a record
    /// that may still fail. A hold whose record failed is not taken.
    pub fn hold(
        &self,
        session: SessionId,
        ns: &str,
        keys: &[String],
        hold: bool,
    ) -> Result<Vec<Result<()>>> {
        split_ns(ns)?;
        let mut st = self.lock();
        let c = st.caller(session)?;
        if hold {
            self.wait_imminent(&mut st, ns, keys);
            // A record ends within etcd's patience; one that does not (its thread stopped)
            // holds up these holds no longer than this.
            let deadline = Instant::now() + PIN_WAIT;
            while keys.iter().any(|k| pin_in_flight(&st, ns, k)) {
                if st.wait_until(&self.sealed, deadline).timed_out() {
                    return Err(Error::Busy(format!(
                        "{ns}: another client's first hold of one of these entries is still \
                         being recorded for its publisher; retry"
                    )));
                }
            }
        }
        // Other hosts' entries whose first hold here was taken (or last given back): their
        // publisher must know.
        let mut firsts: Vec<u64> = Vec::new();
        let mut out = Self::each_entry(
            &mut st,
            &c,
            ns,
            keys,
            if hold {
                |p| Access::Read(p)
            } else {
                |_| Access::Lookup
            },
            |st, ino| {
                st.hold(session, ino, hold)?;
                let e = &st.entries[&ino];
                if e.remote().is_some() && e.holds() == u32::from(hold) {
                    firsts.push(ino);
                }
                Ok(())
            },
        )?;
        if firsts.is_empty() {
            return Ok(out);
        }
        let names: Vec<(String, String)> = firsts
            .iter()
            .map(|ino| (ns.to_owned(), st.entries[ino].key().to_owned()))
            .collect();
        if !hold {
            self.authority.unpin_for_clients(&names);
            return Ok(out);
        }
        let Err(e) = self.record_first_holds(&mut st, &firsts, &names) else {
            return Ok(out);
        };
        // Not recorded for the publisher: the holds this call took on these entries are not
        // taken (no other session's hold of them was taken meanwhile; the record, should it
        // have landed all the same, is taken back).
        let mut unpinned = Vec::new();
        for (ino, name) in firsts.into_iter().zip(names) {
            let mut held = false;
            for (k, o) in keys.iter().zip(out.iter_mut()) {
                if *k != name.1 || o.is_err() {
                    continue;
                }
                held |= st.hold(session, ino, false).is_ok();
                *o = Err(Error::Busy(format!(
                    "{ns}/{k}: pinning another host's entry: {e}"
                )));
            }
            if held && st.entries.get(&ino).is_some_and(|e| e.holds() == 0) {
                unpinned.push(name);
            }
        }
        if !unpinned.is_empty() {
            self.authority.unpin_for_clients(&unpinned);
        }
        Ok(out)
    }

    /// Records the first holds here of other hosts' entries `firsts` (named `names`) at the
    /// authority: asked under the store's lock (in its order with the unpins), waited for
    /// without it, the entries marked meanwhile so that other holds of them wait.
    fn record_first_holds(
        &self,
        st: &mut Locked<'_>,
        firsts: &[u64],
        names: &[(String, String)],
    ) -> Result<()> {
        let record = self.authority.pin_for_clients(names);
        st.pinning.extend(firsts.iter().copied());
        let outcome = st.unlocked(|| record.wait());
        for ino in firsts {
            st.pinning.remove(ino);
        }
        self.sealed.notify_all();
        outcome
    }

    /// A client went away (closed its connection or crashed): its unpublished allocations
    /// are freed, its leases and holds dropped and its open regions detached.
    pub fn close_session(&self, id: SessionId) {
        if id == SessionId::MOUNT {
            return;
        }
        let mut st = self.lock();
        let Some(s) = st.sessions.remove(&id) else {
            return;
        };
        for a in s.allocs {
            self.drop_alloc(&mut st, a);
        }
        for (ino, n) in s.leases {
            st.unlease(&*self.authority, ino, n);
        }
        let unpinned: Vec<(String, String)> = s
            .holds
            .into_iter()
            .filter_map(|(ino, n)| st.unhold(ino, n))
            .collect();
        if !unpinned.is_empty() {
            self.authority.unpin_for_clients(&unpinned);
        }
        for p in &mut st.pools {
            p.pool.detach(id);
        }
        for e in st.entries.values_mut() {
            e.disown(id);
        }
    }

    /// Drops leases of a session.
    pub fn release(&self, session: SessionId, gens: &[u64]) {
        let mut st = self.lock();
        for g in gens {
            let held = st.sessions.get_mut(&session).is_some_and(|s| {
                let Some(n) = s.leases.get_mut(g) else {
                    return false;
                };
                *n -= 1;
                if *n == 0 {
                    s.leases.remove(g);
                }
                true
            });
            if held {
                st.unlease(&*self.authority, *g, 1);
            }
        }
    }
}

impl State {
    /// Takes (`hold`) or gives back one hold of session `session` on entry `ino`.
    pub fn hold(&mut self, session: SessionId, ino: u64, hold: bool) -> Result<()> {
        let s = self
            .sessions
            .get_mut(&session)
            .ok_or_else(|| Error::Protocol("no such session".into()))?;
        let e = self
            .entries
            .get_mut(&ino)
            .ok_or_else(|| Error::NotFound("entry".into()))?;
        if hold {
            // The entry's count is the sum of the sessions': it overflows first.
            e.add_hold()?;
            *s.holds.entry(ino).or_insert(0) += 1;
        } else {
            let Some(mine) = s.holds.get_mut(&ino) else {
                return Err(Error::NotFound(format!(
                    "{}/{}: not held by this client",
                    e.ns(),
                    e.key()
                )));
            };
            *mine -= 1;
            if *mine == 0 {
                s.holds.remove(&ino);
            }
            e.drop_holds(1);
        }
        if e.holds() == u32::from(hold) {
            // 0 -> 1 or 1 -> 0: the index's held bit changes.
            self.index_flags(ino);
        }
        Ok(())
    }

    /// Gives back `n` holds on entry `ino` (gone entries took their holds with them). The
    /// entry's name when it is another host's and its last hold here went.
    pub fn unhold(&mut self, ino: u64, n: u32) -> Option<(String, String)> {
        let e = self.entries.get_mut(&ino)?;
        e.drop_holds(n);
        if e.holds() > 0 {
            return None;
        }
        let name = e.remote().map(|_| (e.ns().to_owned(), e.key().to_owned()));
        self.index_flags(ino);
        name
    }
}

/// Whether the first hold here of `ns/key` (another host's entry) is being recorded.
fn pin_in_flight(st: &State, ns: &str, key: &str) -> bool {
    st.ns
        .get(ns)
        .ok()
        .and_then(|n| n.entries.get(key))
        .is_some_and(|ino| st.pinning.contains(ino))
}
