//! The store's lock as its verbs hold it ([`Locked`]): when it is let go — at the end of a
//! critical section, around work done without it, or in a wait — what the section appended
//! to a pool's log with `--wal-sync` is taken, and synced once the lock is released, before
//! the verb goes on (the lock's rule: no `fsync` under it). Records of many clients waiting
//! at the same moment share one sync ([`crate::wal::Syncer`]).

use std::ops::{Deref, DerefMut};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};

use super::state::State;
use crate::wal::Unsynced;

/// The store's lock, held.
pub(super) struct Locked<'a> {
    lock: &'a Mutex<State>,
    /// Some while held (taken as the lock is let go for good).
    guard: Option<MutexGuard<'a, State>>,
    /// What the verb appended before it let go of the lock for a while.
    unsynced: Vec<Unsynced>,
}

impl<'a> Locked<'a> {
    pub(super) fn new(lock: &'a Mutex<State>) -> Self {
        Locked {
            lock,
            guard: Some(lock.lock()),
            unsynced: Vec::new(),
        }
    }

    fn guard(&mut self) -> &mut MutexGuard<'a, State> {
        self.guard.as_mut().expect("the store's lock is held")
    }

    /// Takes what the section appended so far and did not sync.
    fn take_unsynced(&mut self) {
        let taken = self.guard().take_unsynced();
        self.unsynced.extend(taken);
    }

    /// Runs `f` without the lock, and takes it again.
    pub(super) fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.take_unsynced();
        MutexGuard::unlocked(self.guard(), f)
    }

    /// Waits on `c`, without the lock meanwhile.
    pub(super) fn wait(&mut self, c: &Condvar) {
        self.take_unsynced();
        c.wait(self.guard());
    }

    /// Waits on `c` until `deadline` at the latest, without the lock meanwhile.
    pub(super) fn wait_until(&mut self, c: &Condvar, deadline: Instant) -> WaitTimeoutResult {
        self.take_unsynced();
        c.wait_until(self.guard(), deadline)
    }
}

impl Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("the store's lock is held")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard()
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.take_unsynced();
        let frees = self.guard().frees_waiting();
        drop(self.guard.take());
        if self.unsynced.is_empty() {
            return;
        }
        for u in self.unsynced.drain(..) {
            if let Err(e) = u.wait() {
                // Appends are refused from here on (`Syncer`): the pool takes no more writes.
                tracing::error!("syncing a pool's log: {e}");
            }
        }
        if frees {
            // The extents whose removals are synced now are freed (as the lock is taken).
            drop(Locked::new(self.lock));
        }
    }
}
