//! Crash injection in a memfs pool's metadata steps (namespace directories, publication
//! renames, deletions, pin xattrs, aborted allocations, records of the pack log for packed
//! entries): the pool stops taking steps after
//! its Nth one, the daemon "dies" (the store is dropped without shutdown), and recovery from
//! that tmpfs is checked against the first N steps of the workload — for every N.
//! Needs root: each run mounts a tmpfs (and unmounts it, also on panic).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use maru::format::Record;
use maru_daemon::pool::PoolSpec;
use maru_daemon::pool::memfs::MetaStep;
use maru_daemon::store::{Eviction, Store, StoreConfig};
use maru_fsd::Caller;

/// A tmpfs pool directory, unmounted on drop (also when a check panics).
struct PoolDir {
    dir: tempfile::TempDir,
}

impl PoolDir {
    fn pool(&self) -> PathBuf {
        self.dir.path().join("pool")
    }
}

impl Drop for PoolDir {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.pool().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C string; unmounting the tmpfs this test mounted.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

fn cfg(dir: &Path) -> (StoreConfig, Vec<PoolSpec>) {
    (
        StoreConfig {
            eviction: Eviction::Lru,
            state_dir: dir.join("state"),
            wal_sync: false,
            max_copy_entry: 1 << 20,
        },
        vec![PoolSpec::parse(&format!("memfs:{}/pool,size=64M", dir.display())).unwrap()],
    )
}

fn data(i: u64) -> Vec<u8> {
    (0..(3000 + i * 1000)).map(|b| (b * 7 + i) as u8).collect()
}

fn ns_of(i: u64) -> &'static str {
    if i % 3 == 2 { "ns/sub" } else { "ns" }
}

/// The scripted workload: namespaces, stores, deletes, pins, a rename out of a pack, an
/// abandoned allocation.
fn workload(store: &Arc<Store>) {
    let root = Caller::root();
    store.mkdir(&root, "ns", 0o755).unwrap();
    store.mkdir(&root, "ns/sub", 0o755).unwrap();
    let s = store.open_session("w", root.clone());
    for i in 0..6u64 {
        let d = data(i);
        let (g, f) = store
            .alloc(s, d.len() as u64, 1, None, None)
            .unwrap()
            .pop()
            .unwrap();
        f.expect("memfs allocations come with a file")
            .write_all_at(&d, 0)
            .unwrap();
        store
            .publish(s, g.alloc, ns_of(i), &format!("k{i}"), None)
            .unwrap();
    }
    let keys = |v: &[u64]| v.iter().map(|i| format!("k{i}")).collect::<Vec<_>>();
    let ok = |r: Vec<maru::Result<()>>| assert!(r.iter().all(Result::is_ok), "{r:?}");
    ok(store.delete(&root, "ns", &keys(&[1, 3])).unwrap());
    ok(store.pin(&root, "ns", &keys(&[0, 4]), true).unwrap());
    ok(store.pin(&root, "ns/sub", &keys(&[2]), true).unwrap());
    ok(store.pin(&root, "ns", &keys(&[4]), false).unwrap());
    // An allocation given back, and one never published: neither may survive.
    let (g, _) = store.alloc(s, 5000, 1, None, None).unwrap().pop().unwrap();
    store.free(s, &[g.alloc]).unwrap();
    store.alloc(s, 7000, 1, None, None).unwrap();
    // Packed: allocations of a session that says it publishes in `ns`.
    let p = store.open_session("p", root.clone());
    for i in 6..11u64 {
        let d = data(i);
        let (g, f) = store
            .alloc(p, d.len() as u64, 1, None, Some("ns"))
            .unwrap()
            .pop()
            .unwrap();
        f.expect("packed allocations come with their pack")
            .write_all_at(&d, g.offset)
            .unwrap();
        // k10 goes elsewhere than its allocation said: into a file of its own.
        let at = if i == 10 { "ns/sub" } else { "ns" };
        store
            .publish(p, g.alloc, at, &format!("k{i}"), None)
            .unwrap();
    }
    ok(store.delete(&root, "ns", &keys(&[7])).unwrap());
    ok(store.pin(&root, "ns", &keys(&[8]), true).unwrap());
    // A packed entry renamed into another namespace: it leaves its pack (a file of its own,
    // then the pack log lets it go); a crash between the two finds it once, renamed.
    let fs = maru_daemon::store::fsview::StoreFs(store.clone());
    let ino = |path: &str| {
        use maru_fsd::Backend;
        path.split('/')
            .fold(maru_fsd::backend::ROOT_INO, |at, part| {
                fs.lookup(&root, at, part).unwrap().ino
            })
    };
    {
        use maru_fsd::Backend;
        fs.rename(&root, ino("ns"), "k9", ino("ns/sub"), "k9")
            .unwrap();
    }
    let (g, _) = store
        .alloc(p, 4000, 1, None, Some("ns"))
        .unwrap()
        .pop()
        .unwrap();
    store.free(p, &[g.alloc]).unwrap();
    store.alloc(p, 4000, 1, None, Some("ns")).unwrap();
}

/// Runs the workload with a pool that takes `limit` metadata steps; returns every step the
/// pool was asked to take, and the directory (its tmpfs still mounted, as after a crash).
fn run(limit: i64) -> (Vec<MetaStep>, PoolDir) {
    let dir = PoolDir {
        dir: tempfile::Builder::new()
            .prefix("maru-memfs-crash-")
            .tempdir_in("/tmp")
            .unwrap(),
    };
    let (c, specs) = cfg(dir.dir.path());
    let store = Store::open(c, &specs).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let left = Arc::new(AtomicI64::new(limit));
    let (s2, l2) = (seen.clone(), left.clone());
    store.set_memfs_gate(
        0,
        Some(Arc::new(move |step: &MetaStep| {
            s2.lock().unwrap().push(step.clone());
            l2.fetch_sub(1, Ordering::SeqCst) > 0
        })),
    );
    workload(&store);
    drop(store); // the "crash": no shutdown
    let steps = seen.lock().unwrap().clone();
    (steps, dir)
}

/// What the pool holds after the first `n` steps: (ns, key) -> (data index, pinned).
fn model(steps: &[MetaStep]) -> BTreeMap<(String, String), (u64, bool)> {
    let mut m: BTreeMap<(String, String), (u64, bool)> = BTreeMap::new();
    // Packed entries by location.
    let mut at: BTreeMap<u64, (String, String)> = BTreeMap::new();
    for s in steps {
        match s {
            MetaStep::Publish { id, ns, key } => {
                let i: u64 = key[1..].parse().unwrap();
                // Id 0: a packed entry leaving its pack (another mode, another namespace):
                // its copy there (of the same data) is not found again.
                let mut pinned = false;
                if *id == 0
                    && let Some((&off, _)) = at
                        .iter()
                        .find(|(_, k)| m.get(*k).is_some_and(|e: &(u64, bool)| e.0 == i))
                {
                    let k = at.remove(&off).expect("found");
                    pinned = m.remove(&k).is_some_and(|e| e.1);
                }
                m.insert((ns.clone(), key.clone()), (i, pinned));
            }
            MetaStep::Delete { ns, key } => {
                m.remove(&(ns.clone(), key.clone()));
            }
            MetaStep::Pin { ns, key, pinned } => {
                if let Some(e) = m.get_mut(&(ns.clone(), key.clone())) {
                    e.1 = *pinned;
                }
            }
            MetaStep::Rename { ns, key, nns, nkey } => {
                if let Some(e) = m.remove(&(ns.clone(), key.clone())) {
                    m.insert((nns.clone(), nkey.clone()), e);
                }
            }
            MetaStep::Packed(r) => match r {
                Record::Seal {
                    ns, key, off, pin, ..
                } => {
                    let i = key[1..].parse().unwrap();
                    m.insert((ns.clone(), key.clone()), (i, *pin));
                    at.insert(*off, (ns.clone(), key.clone()));
                }
                Record::Del { off } => {
                    if let Some(k) = at.remove(off) {
                        m.remove(&k);
                    }
                }
                Record::Pin { off, pin } => {
                    if let Some(e) = at.get(off).and_then(|k| m.get_mut(k)) {
                        e.1 = *pin;
                    }
                }
                Record::Rename { off, ns, key } => {
                    if let Some(k) = at.get_mut(off)
                        && let Some(e) = m.remove(k)
                    {
                        *k = (ns.clone(), key.clone());
                        m.insert(k.clone(), e);
                    }
                }
            },
            MetaStep::Mkdir { .. } | MetaStep::Abort { .. } => {}
        }
    }
    m
}

/// The bytes of `ns/key` as a reader gets them: its file, or its piece of its pack.
fn bytes_of(store: &Store, ns: &str, key: &str) -> Vec<u8> {
    let s = store.open_session("r", Caller::root());
    let (loc, f) = store
        .retrieve(s, ns, &[key.to_owned()], |_| false)
        .unwrap()
        .pop()
        .unwrap()
        .unwrap_or_else(|| panic!("{ns}/{key} not found"));
    store.close_session(s);
    let off = maru::index::packed(loc.offset).map_or(0, |(_, o)| o);
    let mut b = vec![0; loc.size as usize];
    f.expect("a descriptor").read_exact_at(&mut b, off).unwrap();
    b
}

/// Whether a test that needs root runs: as root, yes; otherwise it says it is skipped, or
/// fails under `MARU_REQUIRE_ROOT=1` (CI). (maru-tests' `require_root!`, which this crate
/// cannot depend on.)
fn root_or_skip(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var_os("MARU_REQUIRE_ROOT").is_some_and(|v| v == "1") {
        panic!("{test} needs root, and MARU_REQUIRE_ROOT=1 says this run has it: run as root");
    }
    eprintln!("skipped: {test} needs root");
    false
}

#[test]
fn recovery_from_every_metadata_step() {
    // It mounts a tmpfs.
    if !root_or_skip("memfs_crash_injection::recovery_from_every_metadata_step") {
        return;
    }
    let (all, _full) = run(i64::MAX);
    assert!(
        // 2 namespaces, 7 publications, 2 deletions, 3 pins, 1 abort; 4 packed seals, 1
        // deletion and 1 pin in the pack log.
        all.len() >= 21,
        "the workload took {} steps: {all:?}",
        all.len()
    );
    let root = Caller::root();
    eprintln!("{} metadata steps: {all:?}", all.len());
    for n in 0..=all.len() {
        let (_, dir) = run(n as i64);
        let want = model(&all[..n]);
        let (c, specs) = cfg(dir.dir.path());
        let store = Store::open(c, &specs).unwrap();
        let mut got = BTreeMap::new();
        for ns in ["ns", "ns/sub"] {
            let Ok((_, _, entries, _)) = store.list(&root, ns, None, usize::MAX) else {
                continue;
            };
            for e in entries {
                got.insert((ns.to_owned(), e.key.clone()), (e.size, e.pinned));
            }
        }
        let want_view: BTreeMap<_, _> = want
            .iter()
            .map(|(k, (i, p))| (k.clone(), (data(*i).len() as u64, *p)))
            .collect();
        assert_eq!(
            got,
            want_view,
            "after step {n} of {}: {:?}",
            all.len(),
            all.get(n)
        );
        for ((ns, key), (i, _)) in &want {
            assert_eq!(
                bytes_of(&store, ns, key),
                data(*i),
                "{ns}/{key} after step {n}"
            );
        }
        store
            .check_invariants()
            .unwrap_or_else(|m| panic!("after step {n}: {m}"));
        assert_eq!(
            std::fs::read_dir(dir.pool().join("w")).unwrap().count(),
            0,
            "after step {n}: an unpublished allocation survived"
        );
        assert_eq!(store.pools()[0].writing_bytes, 0);
        // No leak: once everything is deleted the pool holds nothing.
        for ns in ["ns", "ns/sub"] {
            let keys: Vec<String> = want
                .keys()
                .filter(|(n2, _)| n2 == ns)
                .map(|(_, k)| k.clone())
                .collect();
            if !keys.is_empty() {
                store.pin(&root, ns, &keys, false).unwrap();
                store.delete(&root, ns, &keys).unwrap();
            }
        }
        let p = &store.pools()[0];
        assert_eq!(p.entries, 0, "after step {n}");
        assert!(
            p.used < 64 << 10,
            "after step {n}: {} bytes still used",
            p.used
        );
        drop(store);
    }
}
