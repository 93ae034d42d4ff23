//! The store's lock as its verbs hold it ([`Locked`]): when it is let go — at the end of a
//! critical section, around work done without it, or in a wait — what the section appended
//! to a pool's log with `--wal-sync` is taken, and synced once the lock is released, before
//! the verb goes on (the lock's rule: no `fsync` under it). Records of many clients waiting
//! at the same moment share one sync ([`crate::wal::Syncer`]).

use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};

use super::state::State;
use crate::wal::Unsynced;

thread_local! {
    /// How many of the store's locks this thread holds (one store, or several in tests).
    static HELD: Cell<u32> = const { Cell::new(0) };
    /// Why a sync this thread's verb waited for failed, for the verb's answer.
    static SYNC_FAILED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Takes the failure of a sync that the verb this thread served last waited for
/// (`--wal-sync`): a verb whose record is not durable answers with it, not with a success.
/// The servers take it after each verb (and before, so that none inherits another's).
pub fn take_sync_failure() -> Option<maru::Error> {
    SYNC_FAILED.with(|f| f.borrow_mut().take()).map(|e| {
        maru::Error::Io(std::io::Error::other(format!(
            "a pool's log could not be synced ({e}): what this changed may not survive a \
             crash, and the pool takes no more writes"
        )))
    })
}

/// Waits until every record of `pending` is synced; a failure is logged and kept for the
/// verb's answer ([`take_sync_failure`]).
fn wait_synced(pending: impl IntoIterator<Item = Unsynced>) {
    for u in pending {
        if let Err(e) = u.wait() {
            // Appends are refused from here on (`Syncer`): the pool takes no more writes.
            tracing::error!("syncing a pool's log: {e}");
            SYNC_FAILED.with(|f| *f.borrow_mut() = Some(e.to_string()));
        }
    }
}

fn held(by: i32) {
    HELD.with(|h| h.set(h.get().wrapping_add_signed(by)));
}

/// Whether this thread holds a store's lock.
pub fn held_here() -> bool {
    HELD.with(|h| h.get() > 0)
}

/// Checks (in debug builds, every test's) that what follows — a sync, an `fallocate`, a
/// network round trip: `what` — does not run under the store's lock (the lock's rule).
#[track_caller]
pub fn assert_unlocked(what: &str) {
    debug_assert!(!held_here(), "{what} under the store's lock");
}

/// Runs `f` with the lock's count let go (the guard's own release or wait does the rest),
/// counted again however `f` ends.
fn released<R>(f: impl FnOnce() -> R) -> R {
    struct Again;
    impl Drop for Again {
        fn drop(&mut self) {
            held(1);
        }
    }
    held(-1);
    let _again = Again;
    f()
}

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
        let guard = lock.lock();
        held(1);
        Locked {
            lock,
            guard: Some(guard),
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
        let g = self.guard();
        released(|| MutexGuard::unlocked(g, f))
    }

    /// Syncs what the verb appended so far, without the lock meanwhile, and takes it again:
    /// the extents whose removals that synced are free then (an eviction's, before the
    /// grant it made room for).
    pub(super) fn sync(&mut self) {
        self.take_unsynced();
        if self.unsynced.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.unsynced);
        let g = self.guard();
        released(|| MutexGuard::unlocked(g, || wait_synced(pending)));
        self.take_unsynced();
    }

    /// Waits on `c`, without the lock meanwhile.
    pub(super) fn wait(&mut self, c: &Condvar) {
        self.take_unsynced();
        let g = self.guard();
        released(|| c.wait(g));
    }

    /// Waits on `c` until `deadline` at the latest, without the lock meanwhile.
    pub(super) fn wait_until(&mut self, c: &Condvar, deadline: Instant) -> WaitTimeoutResult {
        self.take_unsynced();
        let g = self.guard();
        released(|| c.wait_until(g, deadline))
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
        drop(self.guard.take());
        held(-1);
        if self.unsynced.is_empty() {
            return;
        }
        wait_synced(self.unsynced.drain(..));
        // The extents whose removals are synced now are freed as the lock is taken: this
        // verb's, and those another verb queued on this one's records while they synced
        // (it appended nothing, so it waited for nothing).
        drop(Locked::new(self.lock));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count follows the lock: held, let go around work and waits, given back at the end.
    #[test]
    fn the_lock_is_known_held_exactly_while_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let m = Mutex::new(State::empty(dir.path()));
        assert!(!held_here());
        let mut l = Locked::new(&m);
        assert!(held_here());
        l.unlocked(|| {
            assert!(!held_here());
            assert!(m.try_lock().is_some(), "let go meanwhile");
        });
        assert!(held_here());
        let c = Condvar::new();
        let _ = l.wait_until(&c, Instant::now() + std::time::Duration::from_millis(1));
        assert!(held_here());
        drop(l);
        assert!(!held_here());
        assert!(m.try_lock().is_some());
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "a sync under the store's lock")]
    fn a_slow_call_under_the_lock_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let m = Mutex::new(State::empty(dir.path()));
        let _l = Locked::new(&m);
        assert_unlocked("a sync");
    }
}
