//! Crash injection in the raw pool's metadata log: the log stops (or tears a record) after
//! its Nth write, the daemon "dies" (the store is dropped without shutdown), and recovery
//! from that image is checked — for every N of a scripted workload.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use maru::format::{self, Record};
use maru_daemon::pool::PoolSpec;
use maru_daemon::store::{Eviction, Store, StoreConfig};
use maru_daemon::wal::{Durability, FileSink, LogSink};
use maru_fsd::Caller;

/// Passes writes through until its budget is spent, then drops them (a crash at that point).
struct Stopping {
    inner: FileSink,
    left: Arc<AtomicI64>,
    torn: bool,
    seen: Arc<Mutex<Vec<Record>>>,
}

impl LogSink for Stopping {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.seen
            .lock()
            .unwrap()
            .extend(format::decode_records(bytes).0);
        match self.left.fetch_sub(1, Ordering::SeqCst) {
            n if n > 1 => self.inner.append(bytes),
            1 if self.torn => self.inner.append(&bytes[..bytes.len() / 2]),
            1 => self.inner.append(bytes),
            _ => Ok(()),
        }
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn replace(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.left.load(Ordering::SeqCst) > 0 {
            self.inner.replace(bytes)
        } else {
            Ok(())
        }
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn file(&self) -> (&std::path::Path, Durability) {
        self.inner.file()
    }
    fn swap(&mut self, tmp: &std::path::Path, upto: u64) -> std::io::Result<()> {
        if self.left.load(Ordering::SeqCst) > 0 {
            self.inner.swap(tmp, upto)
        } else {
            Ok(())
        }
    }
}

fn cfg(dir: &std::path::Path) -> (StoreConfig, Vec<PoolSpec>) {
    (
        StoreConfig {
            eviction: Eviction::Lru,
            state_dir: dir.join("state"),
            wal_sync: false,
            max_copy_entry: 1 << 20,
        },
        vec![
            PoolSpec::parse(&format!("file:{}/dev.img,size=32M,name=emu", dir.display())).unwrap(),
        ],
    )
}

fn data(i: u64) -> Vec<u8> {
    (0..(3000 + i * 1000)).map(|b| (b * 7 + i) as u8).collect()
}

/// The scripted workload: stores, deletes, pins; returns nothing, the log tells what happened.
fn workload(store: &Store) {
    let root = Caller::root();
    store.mkdir(&root, "ns", 0o755).unwrap();
    let s = store.open_session("w", root.clone());
    let dev = store.raw_pool_fd(0, true).unwrap();
    for i in 0..8u64 {
        let d = data(i);
        let (g, _) = store
            .alloc(s, d.len() as u64, 1, None, None)
            .unwrap()
            .pop()
            .unwrap();
        dev.write_all_at(&d, g.offset).unwrap();
        store
            .publish(s, g.alloc, "ns", &format!("k{i}"), None)
            .unwrap();
    }
    let keys = |v: &[u64]| v.iter().map(|i| format!("k{i}")).collect::<Vec<_>>();
    assert!(
        store
            .delete(&root, "ns", &keys(&[1, 4]))
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    assert!(
        store
            .pin(&root, "ns", &keys(&[2, 5]), true)
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    assert!(
        store
            .pin(&root, "ns", &keys(&[5]), false)
            .unwrap()
            .iter()
            .all(Result::is_ok)
    );
    // An allocation never published: must not survive.
    store.alloc(s, 5000, 1, None, None).unwrap();
}

fn run(limit: i64, torn: bool) -> (Vec<Record>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (c, specs) = cfg(dir.path());
    let store = Store::open(c.clone(), &specs).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let uuid = format::read_header(&std::fs::File::open(dir.path().join("dev.img")).unwrap())
        .unwrap()
        .unwrap()
        .uuid_string();
    let sink = FileSink::open(
        &c.state_dir.join(format!("pool-{uuid}.wal")),
        Durability::Checkpoints,
    )
    .unwrap();
    store.set_log_sink(
        0,
        Box::new(Stopping {
            inner: sink,
            left: Arc::new(AtomicI64::new(limit)),
            torn,
            seen: seen.clone(),
        }),
    );
    workload(&store);
    drop(store); // the "crash": no shutdown, no sync
    let recs = seen.lock().unwrap().clone();
    (recs, dir)
}

#[test]
fn recovery_from_every_write_point() {
    let (all, _) = run(i64::MAX, false);
    assert!(
        all.len() >= 8 + 2 + 3,
        "the workload wrote {} records",
        all.len()
    );
    for n in 0..=all.len() as i64 {
        for torn in [false, true] {
            let (_, dir) = run(n, torn);
            // Expected: the first n records (n-1 if the nth was torn) applied.
            let kept = if torn { (n - 1).max(0) } else { n } as usize;
            let want = format::replay(all[..kept.min(all.len())].to_vec());
            let (c, specs) = cfg(dir.path());
            let store = Store::open(c, &specs).unwrap();
            let (_, _, entries, _) = store.list(&Caller::root(), "ns", None, usize::MAX).unwrap();
            assert_eq!(entries.len(), want.len(), "write point {n} torn={torn}");
            let dev = std::fs::File::open(dir.path().join("dev.img")).unwrap();
            for e in &entries {
                let i: u64 = e.key[1..].parse().unwrap();
                let Some(Record::Seal { off, size, pin, .. }) = want
                    .values()
                    .find(|r| matches!(r, Record::Seal { key, .. } if *key == e.key))
                else {
                    panic!(
                        "{} recovered at write point {n} but not in the log prefix",
                        e.key
                    );
                };
                assert_eq!(
                    (e.offset, e.size, e.pinned),
                    (*off, *size, *pin),
                    "{} at write point {n}",
                    e.key
                );
                let mut buf = vec![0u8; e.size as usize];
                dev.read_exact_at(&mut buf, e.offset).unwrap();
                assert_eq!(buf, data(i), "{} bytes at write point {n}", e.key);
            }
            store
                .check_invariants()
                .unwrap_or_else(|m| panic!("write point {n} torn={torn}: {m}"));
            let pool = &store.pools()[0];
            assert_eq!(
                pool.writing_bytes, 0,
                "write point {n}: an allocation survived"
            );
            assert_eq!(pool.entries as usize, want.len());
            // No leak: once everything is deleted the pool is empty.
            let keys: Vec<String> = entries.iter().map(|e| e.key.clone()).collect();
            store.pin(&Caller::root(), "ns", &keys, false).unwrap();
            store.delete(&Caller::root(), "ns", &keys).unwrap();
            assert_eq!(store.pools()[0].used, 0, "write point {n}: leaked space");
        }
    }
}
