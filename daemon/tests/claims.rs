//! A region's claim at a shared authority (etcd, in cluster mode: a round trip) is made
//! without the store's lock: other clients go on while one waits for its claim, and a claim
//! refused (another host's region) or failed leaves nothing behind. An authority that other
//! hosts share in name only stands in for etcd: it holds claims while the test says so,
//! and refuses those it is told to.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Duration;

use maru::{Error, Result};
use maru_daemon::store::Store;
use maru_daemon::store::authority::{Authority, Claim, LocalAuthority, Placed};
use maru_daemon::store::fsview::StoreFs;
use maru_fsd::backend::ROOT_INO;
use maru_fsd::{Backend, Caller};

mod common;

/// Long enough for anything that is not stuck.
const WAIT: Duration = Duration::from_secs(30);

/// A single host's authority that says other hosts share it: claims wait while `held`, and
/// are refused as another host's (`refuse`, the next ones; `refuse_all`) or fail (`fail`).
#[derive(Default)]
struct Gated {
    inner: LocalAuthority,
    held: Mutex<bool>,
    let_go: Condvar,
    waiting: AtomicUsize,
    refuse: AtomicUsize,
    refuse_all: AtomicBool,
    fail: AtomicBool,
    refused: Mutex<HashSet<u64>>,
}

impl Gated {
    fn hold(&self, held: bool) {
        *self.held.lock().unwrap() = held;
        self.let_go.notify_all();
    }
}

impl Authority for Gated {
    fn reserve(&self, ns: &str, key: &str, id: u64) -> Result<()> {
        self.inner.reserve(ns, key, id)
    }
    fn publish(&self, ns: &str, key: &str, id: u64, at: &Placed<'_>) -> Result<()> {
        self.inner.publish(ns, key, id, at)
    }
    fn release(&self, ns: &str, key: &str, id: u64) {
        self.inner.release(ns, key, id)
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
        let mut held = self.held.lock().unwrap();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while *held {
            held = self.let_go.wait(held).unwrap();
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        if self.fail.load(Ordering::SeqCst) {
            return Err(Error::Io(std::io::Error::other("etcd is unreachable")));
        }
        let next = self
            .refuse
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if next || self.refuse_all.load(Ordering::SeqCst) {
            self.refused.lock().unwrap().insert(offset);
            return Err(Error::Busy(format!("{offset:#x} is another host's")));
        }
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
    auth: Arc<Gated>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    /// A store on a `file:` pool of `mib` MiB and a [`Gated`] authority, with namespace `ns`.
    fn new(mib: u64) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let auth = Arc::new(Gated::default());
        let (store, _) = common::store_on_file_pool(dir.path(), mib, auth.clone());
        Fixture {
            store,
            auth,
            _dir: dir,
        }
    }

    /// Stores `data` as `ns/key` over the socket; the offset it got.
    fn put(&self, key: &str, data: &[u8]) -> Result<u64> {
        common::put(&self.store, key, data)
    }

    /// The bytes of `ns/key` (None: absent).
    fn get(&self, key: &str) -> Option<Vec<u8>> {
        let s = self.store.open_session("t", Caller::root());
        let found = self
            .store
            .retrieve(s, "ns", &[key.to_owned()], |_| false)
            .unwrap()
            .pop()
            .unwrap()
            .map(|(loc, _)| {
                let mut b = vec![0; loc.size as usize];
                let dev = self.store.raw_pool_fd(loc.pool, false).unwrap();
                dev.read_exact_at(&mut b, loc.offset).unwrap();
                b
            });
        self.store.close_session(s);
        found
    }

    /// The pool's bytes not in use (nor set aside as other hosts').
    fn free(&self) -> u64 {
        let p = &self.store.pools()[0];
        p.capacity - p.used
    }

    /// Waits until `n` claims wait at the authority.
    fn claims_waiting(&self, n: usize) {
        let deadline = std::time::Instant::now() + WAIT;
        while self.auth.waiting.load(Ordering::SeqCst) != n {
            assert!(
                std::time::Instant::now() < deadline,
                "{n} claims never waited"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// While one client's allocation waits for its region's claim, another client retrieves and
/// lists: neither waits for the claim.
#[test]
fn a_claim_in_flight_stalls_no_other_client() {
    let f = Fixture::new(64);
    f.put("before", b"stored before").unwrap();
    f.auth.hold(true);
    std::thread::scope(|s| {
        let waiting = s.spawn(|| f.put("claiming", &[7; 4096]));
        f.claims_waiting(1);
        let (done_tx, done_rx) = mpsc::channel();
        let fr = &f;
        s.spawn(move || {
            let got = fr.get("before");
            let listed = fr
                .store
                .list(&Caller::root(), "ns", None, usize::MAX)
                .map(|l| l.2.len());
            done_tx.send((got, listed)).unwrap();
        });
        let answer = done_rx.recv_timeout(WAIT);
        // Let go before asserting: a failure must not leave the claim waiting.
        f.auth.hold(false);
        let (got, listed) = answer.expect("a retrieval waited for another client's claim");
        assert_eq!(got.as_deref(), Some(&b"stored before"[..]));
        assert_eq!(listed.unwrap(), 1);
        waiting.join().unwrap().unwrap();
    });
    assert_eq!(f.get("claiming").unwrap(), vec![7; 4096]);
    f.store.check_invariants().unwrap();
}

/// A region another host claimed first is set aside: the allocation gets another, nothing of
/// the refused one is used or lost, and once the pool looks full it is tried again.
#[test]
fn a_region_another_host_claimed_first_is_set_aside() {
    let f = Fixture::new(64);
    let free = f.free();
    f.auth.refuse.store(1, Ordering::SeqCst);
    let at = f.put("k", &[1; 4096]).unwrap();
    let refused: Vec<u64> = f.auth.refused.lock().unwrap().iter().copied().collect();
    assert_eq!(refused.len(), 1);
    assert!(
        !(refused[0]..refused[0] + (2 << 20)).contains(&at),
        "placed at {at:#x}, in the region refused"
    );
    assert_eq!(f.get("k").unwrap(), vec![1; 4096]);
    f.store.check_invariants().unwrap();
    // The refused region is set aside, not free, until the pool looks full: then tried again.
    assert_eq!(f.free(), free - 2 * (2 << 20));
    let big = f.free() as usize;
    f.put("rest", &vec![2; big]).unwrap();
    let s = f.store.open_session("t", Caller::root());
    let again = f
        .store
        .alloc(s, 4096, 1, None, None)
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(
        again.0.offset, refused[0],
        "the region set aside, tried again"
    );
    f.store.close_session(s);
    f.store.check_invariants().unwrap();
}

/// When other hosts refuse every free region the pool is full for this host (each region
/// tried, then those set aside once more); when the claim fails (etcd unreachable), the
/// allocation fails with that error and its region is free again. Nothing is lost.
#[test]
fn a_refused_or_failed_claim_loses_nothing() {
    let f = Fixture::new(16);
    let free = f.free();
    f.auth.refuse_all.store(true, Ordering::SeqCst);
    let full = f.put("k", &[1; 4096]).unwrap_err();
    assert!(matches!(full, Error::NoSpace(_)), "{full:?}");
    // Every region was refused; the last one refused stays set aside as another host's.
    assert_eq!(
        f.auth.refused.lock().unwrap().len() as u64,
        free / (2 << 20)
    );
    let set_aside = f.free();
    assert_eq!(set_aside, free - (2 << 20));
    f.auth.refuse_all.store(false, Ordering::SeqCst);
    f.auth.fail.store(true, Ordering::SeqCst);
    let failed = f.put("k", &[1; 4096]).unwrap_err();
    assert!(failed.to_string().contains("unreachable"), "{failed}");
    assert_eq!(f.free(), set_aside);
    f.auth.fail.store(false, Ordering::SeqCst);
    assert!(f.get("k").is_none());
    f.store.check_invariants().unwrap();
    f.put("k", &[1; 4096]).unwrap();
    assert_eq!(f.get("k").unwrap(), vec![1; 4096]);
    f.store
        .delete(&Caller::root(), "ns", &["k".into()])
        .unwrap();
    assert_eq!(f.free(), set_aside);
    f.store.check_invariants().unwrap();
}

/// A writer through the mount whose close carves a region: the claim is made without the
/// store's lock too, and a region refused is replaced by another before the bytes go there.
#[test]
fn a_writer_through_the_mount_claims_its_region_without_the_lock() {
    let f = Fixture::new(64);
    f.put("before", b"stored before").unwrap();
    let fs = StoreFs(f.store.clone());
    let root = Caller::root();
    let parent = fs.lookup(&root, ROOT_INO, "ns").unwrap().ino;
    let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    let (a, _) = fs.create(&root, parent, "w", 0o644).unwrap();
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        fs.write(a.ino, (i << 20) as u64, chunk).unwrap();
    }
    f.auth.refuse.store(1, Ordering::SeqCst);
    f.auth.hold(true);
    std::thread::scope(|s| {
        let closing = s.spawn(|| fs.commit(&root, a.ino, false));
        f.claims_waiting(1);
        let (done_tx, done_rx) = mpsc::channel();
        let fr = &f;
        s.spawn(move || done_tx.send(fr.get("before")).unwrap());
        let answer = done_rx.recv_timeout(WAIT);
        f.auth.hold(false);
        assert_eq!(
            answer
                .expect("a retrieval waited for a writer's claim")
                .as_deref(),
            Some(&b"stored before"[..])
        );
        closing.join().unwrap().unwrap();
    });
    fs.seal(a.ino).unwrap();
    assert_eq!(f.auth.refused.lock().unwrap().len(), 1);
    assert_eq!(f.get("w").unwrap(), data);
    f.store.check_invariants().unwrap();
}

/// In a pool shared with other hosts, a region emptied goes back at once, though its session
/// stays (the mount's writers never leave): kept for the session's next allocations, it is
/// room no other host could use.
#[test]
fn an_emptied_region_goes_back_though_its_session_stays() {
    let f = Fixture::new(64);
    let free = f.free();
    let s = f.store.open_session("t", Caller::root());
    let (g, _) = f
        .store
        .alloc(s, 4096, 1, None, None)
        .unwrap()
        .pop()
        .unwrap();
    f.store.publish(s, g.alloc, "ns", "k", None).unwrap();
    assert_eq!(f.free(), free - (2 << 20));
    f.store
        .delete(&Caller::root(), "ns", &["k".into()])
        .unwrap();
    assert_eq!(f.free(), free, "the session's emptied region is given back");
    // Through the mount likewise.
    let fs = StoreFs(f.store.clone());
    let root = Caller::root();
    let parent = fs.lookup(&root, ROOT_INO, "ns").unwrap().ino;
    let (a, _) = fs.create(&root, parent, "w", 0o644).unwrap();
    fs.write(a.ino, 0, b"through the mount").unwrap();
    fs.commit(&root, a.ino, false).unwrap();
    fs.seal(a.ino).unwrap();
    assert_eq!(f.free(), free - (2 << 20));
    f.store.delete(&root, "ns", &["w".into()]).unwrap();
    assert_eq!(
        f.free(),
        free,
        "the mount writers' emptied region is given back"
    );
    f.store.close_session(s);
    f.store.check_invariants().unwrap();
}
