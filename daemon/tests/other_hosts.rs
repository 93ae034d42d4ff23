//! What a host owes the others for their entries and its own, with an authority that other
//! hosts share in name only (it stands in for etcd): which of another host's entries clients
//! here use (a removal of one makes this host hold its extent until they let go), and which
//! removed extents of this host's the other hosts still map (freed once they let go).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use maru::Result;
use maru_daemon::store::SharedId;
use maru_daemon::store::Store;
use maru_daemon::store::authority::{Authority, Claim, LocalAuthority, Placed, Withdrawn};
use maru_daemon::store::fsview::StoreFs;
use maru_fsd::backend::ROOT_INO;
use maru_fsd::{Backend, Caller};

mod common;

/// One test at a time: one leaves the process no descriptor to open for a moment.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Where another host's entry lies in the pool (a region this host never carves first).
const THEIRS_AT: u64 = 32 << 20;

/// A single host's authority that says other hosts share it, and keeps what the store tells
/// it of other hosts' entries and of its own removed extents.
#[derive(Default)]
struct Elsewhere {
    inner: LocalAuthority,
    /// Other hosts' entries clients here use ([`Authority::use_remote`], until
    /// [`Authority::idle_remote`]).
    used: Mutex<HashSet<SharedId>>,
    /// The offsets of this host's removed extents that other hosts may still map: every
    /// removal's, until the test lets go of it.
    held: Mutex<HashSet<u64>>,
}

impl Authority for Elsewhere {
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        self.inner.reserve(ns, key, id)
    }
    fn publish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<()> {
        self.inner.publish(ns, key, id, at)
    }
    fn release(&self, ns: &str, key: &str, id: u64) {
        self.inner.release(ns, key, id)
    }
    fn unpublish(
        &self,
        ns: &str,
        key: &str,
        id: u64,
        at: &Placed<'_>,
        _withdrawn: Option<Withdrawn>,
    ) -> Result<bool> {
        self.inner.release(ns, key, id);
        self.held.lock().unwrap().insert(at.offset());
        Ok(true)
    }
    fn held_elsewhere(&self, _pool: &str, offset: u64) -> bool {
        self.held.lock().unwrap().contains(&offset)
    }
    fn use_remote(&self, id: SharedId) -> bool {
        self.used.lock().unwrap().insert(id);
        true
    }
    fn idle_remote(&self, id: SharedId) {
        self.used.lock().unwrap().remove(&id);
    }
    fn adopt(&self, ns: &str, key: &str, id: u64) {
        self.inner.adopt(ns, key, id)
    }
    fn forget(&self, ns: &str, key: &str) {
        self.inner.forget(ns, key)
    }
    fn holder(&self, ns: &str, key: &str) -> Option<Claim> {
        self.inner.holder(ns, key)
    }
    fn claim_region(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.inner.claim_region(pool, offset, len)
    }
    fn release_region(&self, pool: &str, offset: u64) {
        self.inner.release_region(pool, offset)
    }
    fn regions(&self, pool: &str) -> Vec<(u64, u64)> {
        self.inner.regions(pool)
    }
    fn shared(&self) -> bool {
        true
    }
}

struct Fixture {
    store: Arc<Store>,
    auth: Arc<Elsewhere>,
    /// The pool's UUID.
    uuid: String,
    _dir: tempfile::TempDir,
    _one: MutexGuard<'static, ()>,
}

impl Fixture {
    /// A store on a 64 MiB `file:` pool and an [`Elsewhere`] authority, with namespace `ns`.
    fn new() -> Fixture {
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let auth = Arc::new(Elsewhere::default());
        let (store, uuid) = common::store_on_file_pool(dir.path(), 64, auth.clone());
        Fixture {
            store,
            auth,
            uuid,
            _dir: dir,
            _one: one,
        }
    }

    /// Stores `data` as `ns/key` over the socket; the offset it got.
    fn put(&self, key: &str, data: &[u8]) -> Result<u64> {
        common::put(&self.store, key, data)
    }

    /// Deletes `ns/key`.
    fn delete(&self, key: &str) {
        let out = self
            .store
            .delete(&Caller::root(), "ns", &[key.to_owned()])
            .unwrap();
        assert!(out.iter().all(Result::is_ok), "{out:?}");
    }

    /// Files `ns/key` as another host's entry of 4 KiB at [`THEIRS_AT`]; which it is.
    fn theirs(&self, key: &str) -> SharedId {
        let filed = self
            .store
            .file_remote(&self.uuid, "ns", key, THEIRS_AT, 4096, 7);
        assert!(filed.unwrap());
        SharedId {
            created: 7,
            offset: THEIRS_AT,
        }
    }

    /// Whether clients here use another host's entry `id`, as the authority was told.
    fn used(&self, id: SharedId) -> bool {
        self.auth.used.lock().unwrap().contains(&id)
    }

    /// The pool's bytes in use.
    fn in_use(&self) -> u64 {
        self.store.pools()[0].used
    }
}

/// Runs `f` with this process unable to open one more descriptor (its limit lowered to the
/// lowest one free), then puts the limit back.
fn without_descriptors<T>(f: impl FnOnce() -> T) -> T {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a valid rlimit to write.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) }, 0);
    // SAFETY: F_GETFD only looks at a descriptor number, open or not.
    let lowest = (3..)
        .find(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1)
        .unwrap();
    let low = libc::rlimit {
        rlim_cur: lowest as libc::rlim_t,
        rlim_max: old.rlim_max,
    };
    // SAFETY: valid rlimits, lowering the soft limit only, then putting it back.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let r = f();
    // SAFETY: the limits read above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) }, 0);
    r
}

/// A retrieval that fails after it readied another host's entry (here the pool's descriptor
/// cannot be had) leaves the entry unused here: marked used with no lease to let go of it,
/// its removal would make this host hold its extent from its publisher for the life of its
/// lease.
#[test]
fn a_failed_retrieval_leaves_another_host_s_entry_unused() {
    let f = Fixture::new();
    let id = f.theirs("theirs");
    let s = f.store.open_session("t", Caller::root());
    let keys = ["theirs".to_owned()];
    let failed = without_descriptors(|| f.store.retrieve(s, "ns", &keys, |_| false).is_err());
    assert!(failed, "the pool's descriptor was had");
    assert!(!f.used(id), "a failed retrieval left it marked used");
    // Retrieved, it is used until the session goes.
    let got = f.store.retrieve(s, "ns", &keys, |_| false).unwrap();
    assert!(got[0].is_some());
    assert!(f.used(id));
    f.store.close_session(s);
    assert!(!f.used(id));
    f.store.check_invariants().unwrap();
}

/// A read through the mount at the end of another host's entry reads nothing and leases
/// nothing: it leaves the entry unused here, as a read of its bytes does once done.
#[test]
fn a_read_at_the_end_of_another_host_s_entry_leaves_it_unused() {
    let f = Fixture::new();
    let id = f.theirs("theirs");
    let fs = StoreFs(f.store.clone());
    let root = Caller::root();
    let ns = fs.lookup(&root, ROOT_INO, "ns").unwrap().ino;
    let ino = fs.lookup(&root, ns, "theirs").unwrap().ino;
    assert_eq!(fs.read(ino, 0, 16).unwrap().len(), 16);
    assert!(!f.used(id), "a read done left it marked used");
    assert!(fs.read(ino, 4096, 16).unwrap().is_empty());
    assert!(!f.used(id), "a read of nothing left it marked used");
}

/// The word that no other host maps a removed extent of this host's any more names its
/// offset, and comes late (the applier's queue, or an eviction's wait without the lock).
/// Meanwhile the entry it was about went with its last lease here, its extent was carved
/// again for another entry, and that one was removed in turn, which the other hosts may
/// still map: the late word frees nothing of it; its own word does.
#[test]
fn a_late_word_that_an_extent_is_unheld_frees_no_later_removal_there() {
    let f = Fixture::new();
    // k1, mapped by a client here when it is deleted: held here and by the other hosts.
    let at = f.put("k1", &[1; 4096]).unwrap();
    let reader = f.store.open_session("reader", Caller::root());
    let got = f
        .store
        .retrieve(reader, "ns", &["k1".to_owned()], |_| false)
        .unwrap();
    let generation = got[0].as_ref().expect("k1").0.generation;
    f.delete("k1");
    // The other hosts let go of it: the word is on its way. The client here lets go too,
    // and its last lease frees the extent.
    f.auth.held.lock().unwrap().remove(&at);
    f.store.release(reader, &[generation]);
    // k2 is carved there, and deleted: the other hosts may map it.
    assert_eq!(
        f.put("k2", &[2; 4096]).unwrap(),
        at,
        "k2 is carved where k1 was"
    );
    f.delete("k2");
    let in_use = f.in_use();
    // The late word about k1.
    f.store.free_unheld(&f.uuid, at);
    assert_eq!(
        f.in_use(),
        in_use,
        "k2's extent was freed while other hosts may map it"
    );
    assert_ne!(f.put("k3", &[3; 4096]).unwrap(), at, "k3 carved over k2");
    // The word about k2 frees it.
    let in_use = f.in_use();
    f.auth.held.lock().unwrap().remove(&at);
    f.store.free_unheld(&f.uuid, at);
    assert!(f.in_use() < in_use, "k2's own word freed nothing");
    f.store.close_session(reader);
    f.store.check_invariants().unwrap();
}
