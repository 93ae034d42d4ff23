//! Client sessions (one per control connection), their leases and their holds.

use maru::{Error, Result};
use maru_fsd::Caller;

use super::SessionId;
use super::Store;
use super::state::{Session, State};

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
