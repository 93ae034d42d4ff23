//! Client sessions (one per control connection) and their leases.

use maru_fsd::Caller;

use super::Store;
use super::state::{MOUNT_SESSION, Session};

impl Store {
    /// Registers a client connection.
    pub fn open_session(&self, name: &str, caller: Caller) -> u64 {
        let mut st = self.st.lock();
        let id = st.next_session.max(MOUNT_SESSION + 1);
        st.next_session = id + 1;
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
    /// are freed, its leases dropped and its open regions detached.
    pub fn close_session(&self, id: u64) {
        if id == MOUNT_SESSION {
            return;
        }
        let mut st = self.st.lock();
        let Some(s) = st.sessions.remove(&id) else {
            return;
        };
        for a in s.allocs {
            self.drop_alloc(&mut st, a);
        }
        for (ino, n) in s.leases {
            st.unlease(ino, n);
        }
        for p in &mut st.pools {
            p.pool.detach(id);
        }
        for e in st.entries.values_mut() {
            if e.owner == Some(id) {
                e.owner = None;
            }
        }
    }

    /// Drops leases of a session.
    pub fn release(&self, session: u64, gens: &[u64]) {
        let mut st = self.st.lock();
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
                st.unlease(*g, 1);
            }
        }
    }
}
