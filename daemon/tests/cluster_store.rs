//! In-process tests of the store in cluster mode: two stores (two hosts) sharing one `file:`
//! pool and a private etcd, each with its authority and applier as marud runs them, and the
//! store's seams to stop a host at a chosen step.
//!
//! Needs Debian's `etcd-server` (skipped without it, unless `MARU_REQUIRE_ROOT` is set).

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use maru_cluster::UNIT;
use maru_cluster::etcd::Range;
use maru_cluster::testing::Etcd;
use maru_daemon::cluster::applier::start_applier;
use maru_daemon::cluster::{ClusterSettings, EtcdAuthority};
use maru_daemon::pool::PoolSpec;
use maru_daemon::store::authority::Authority;
use maru_daemon::store::{Eviction, Store, StoreConfig};
use maru_fsd::Caller;

const POOL: u64 = 64 << 20;

/// One host: its store, on the shared pool `pool` (its device UUID `uuid`).
fn host(etcd: &Etcd, dir: &Path, node: &str, uuid: &str) -> Arc<Store> {
    host_and_authority(etcd, dir, node, uuid).0
}

/// [`host`], and its authority.
fn host_and_authority(
    etcd: &Etcd,
    dir: &Path,
    node: &str,
    uuid: &str,
) -> (Arc<Store>, Arc<EtcdAuthority>) {
    let settings = ClusterSettings {
        endpoints: etcd.endpoints(),
        node: node.to_owned(),
        ttl: Duration::from_secs(10),
    };
    let auth = EtcdAuthority::join(&settings, uuid).expect("joining the cluster");
    let cfg = StoreConfig {
        eviction: Eviction::Off,
        state_dir: dir.join(format!("state-{node}")),
        wal_sync: false,
        max_copy_entry: 1 << 30,
    };
    let spec =
        PoolSpec::parse(&format!("file:{}/cxl.img,size={POOL}", dir.display())).expect("pool spec");
    let store = Store::open_with(cfg, &[spec], auth.clone()).expect("opening the store");
    start_applier(store.clone(), auth.clone()).expect("the applier");
    store
        .mkdir(&Caller::root(), "ns", 0o755)
        .or_else(|e| match e {
            maru::Error::Exists(_) => Ok(0),
            e => Err(e),
        })
        .expect("mkdir ns");
    (store, auth)
}

/// Stores `data` as `ns/key` through `store`'s socket verbs.
fn put(store: &Store, key: &str, data: &[u8]) -> maru::Result<()> {
    let s = store.open_session("t", Caller::root());
    let r = (|| {
        let (g, _) = store
            .alloc(s, data.len() as u64, 1, None, None)?
            .pop()
            .expect("one grant");
        store
            .raw_pool_fd(g.pool, true)?
            .write_all_at(data, g.offset)?;
        store.publish(s, g.alloc, "ns", key, None).map(drop)
    })();
    store.close_session(s);
    r
}

/// The bytes `store` serves as `ns/key` (None: absent).
fn get(store: &Store, key: &str) -> Option<Vec<u8>> {
    let s = store.open_session("t", Caller::root());
    let found = store
        .retrieve(s, "ns", &[key.to_owned()], |_| false)
        .expect("retrieve")
        .pop()
        .expect("one answer")
        .map(|(loc, _)| {
            let mut b = vec![0; loc.size as usize];
            store
                .raw_pool_fd(loc.pool, false)
                .and_then(|f| Ok(f.read_exact_at(&mut b, loc.offset)?))
                .expect("reading the pool");
            b
        });
    store.close_session(s);
    found
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what}: not within 20 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A fresh pool file in `dir`, its device header written; its UUID.
fn pool_file(dir: &Path) -> String {
    let f = std::fs::File::create(dir.join("cxl.img")).expect("pool file");
    f.set_len(POOL).expect("pool size");
    maru::format::init_header(&f)
        .expect("device header")
        .uuid_string()
}

/// A private etcd and a fresh pool file, with hosts `h0` and `h1` on them (the etcd and the
/// directory live as long as the first two).
fn two_hosts() -> Option<(Etcd, tempfile::TempDir, Arc<Store>, Arc<Store>)> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let h0 = host(&etcd, dir.path(), "h0", &uuid);
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    Some((etcd, dir, h0, h1))
}

/// Stops `here` once at `step` for `ns/k` (the store's seam, between etcd's answer and the
/// store's next step) and runs `meanwhile` on `there`; then `there` stores `ns/marker`, and
/// `here` goes on once its applier has filed that (and so everything `there` did before).
/// Returns whether it ran.
fn stop_once(
    here: &Arc<Store>,
    there: &Arc<Store>,
    step: &'static str,
    meanwhile: impl Fn(&Store) + Send + Sync + 'static,
) -> Arc<AtomicBool> {
    let once = Arc::new(AtomicBool::new(false));
    let (ran, me, there) = (once.clone(), Arc::downgrade(here), there.clone());
    here.set_ask_gate(Some(Box::new(move |at, ns, key| {
        if (at, ns, key) != (step, "ns", "k") || once.swap(true, Ordering::SeqCst) {
            return;
        }
        meanwhile(&there);
        put(&there, "marker", b"m").expect("marker");
        let me = me.upgrade().expect("the host stopped");
        eventually("the stopped host serves ns/marker", || {
            get(&me, "marker").is_some()
        });
    })));
    ran
}

/// Another host removes an entry in the moment between etcd granting this host's publication
/// of it and this host sealing it (its removal reaches this host's applier first, when there
/// is nothing here yet to remove). The publication stands (it happened), and the removal
/// applies after it: the entry goes here too, and a later entry of the name, stored
/// elsewhere, is what this host serves — not its own bytes of the removed one.
#[test]
fn a_removal_of_an_entry_arriving_before_its_seal_removes_it_once_sealed() {
    let Some((_etcd, _dir, h0, h1)) = two_hosts() else {
        return;
    };
    // h1 learns of the entry, and deletes it.
    let ran = stop_once(&h0, &h1, "published", |h1| {
        eventually("h1 serves ns/k", || get(h1, "k").is_some());
        let deleted = h1
            .delete(&Caller::root(), "ns", &["k".to_owned()])
            .expect("delete");
        assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    });
    put(&h0, "k", &[1u8; 5000]).expect("the publication was granted: it stands");
    assert!(ran.load(Ordering::SeqCst), "the seam ran");
    eventually("h0 drops ns/k, removed on h1", || get(&h0, "k").is_none());
    assert_eq!(get(&h1, "k"), None);
    // The name stored again, on h1: h0 serves those bytes.
    put(&h1, "k", &[2u8; 3000]).expect("stored again on h1");
    eventually("h0 serves h1's ns/k", || {
        get(&h0, "k").is_some_and(|b| b == [2u8; 3000])
    });
    h0.set_ask_gate(None);
}

/// This host deletes an entry, and in the moment between etcd recording the removal and this
/// host removing the entry here, the name is stored again on another host (whose new entry
/// reaches this host's applier while the name is still taken here by the one going). Once
/// the delete is done, this host serves the new entry: it is not lost for being early.
#[test]
fn a_new_entry_of_a_name_arriving_while_it_is_deleted_here_is_served_after() {
    let Some((_etcd, _dir, h0, h1)) = two_hosts() else {
        return;
    };
    put(&h0, "k", &[1u8; 5000]).expect("stored on h0");
    eventually("h1 serves ns/k", || get(&h1, "k").is_some());
    // h0 learns of the removal, and stores the name again.
    let ran = stop_once(&h1, &h0, "withdrawn", |h0| {
        eventually("h0 drops ns/k", || get(h0, "k").is_none());
        put(h0, "k", &[2u8; 3000]).expect("stored again on h0");
    });
    let deleted = h1
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    assert!(ran.load(Ordering::SeqCst), "the seam ran");
    eventually("h1 serves h0's new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [2u8; 3000])
    });
    assert_eq!(get(&h0, "k"), Some(vec![2u8; 3000]));
    h1.set_ask_gate(None);
}

/// Whether `store`'s index of `ns` names `key`: what clients read without asking marud, and
/// serve themselves from a mapping they kept when the slot is the one they mapped.
fn indexed(store: &Store, key: &str) -> bool {
    let g = store.index_fd(&Caller::root(), "ns").expect("the index");
    // SAFETY: a read-only shared mapping of the index's memfd, read through atomics only.
    let map = unsafe { memmap2::Mmap::map(&g.table) }.expect("mapping the index");
    // SAFETY: the mapping is page-aligned and lives while the table is read.
    let t = unsafe { maru::index::Table::from_raw(map.as_ptr(), map.len()) }.expect("a table");
    t.lookup(key.as_bytes()).is_some()
}

/// A removal of another host's entry that reaches this host while it is deleting the entry
/// itself waits for that delete to settle; this host acknowledges it at once, so the entry's
/// publisher may carve the extent again before the delete is done here. Meanwhile the entry
/// is refused to new readers and out of the index (seed 906: a removal a rejoin found, held
/// back for a delete in flight, was served from an extent carved again meanwhile).
#[test]
fn a_removal_held_back_for_a_delete_here_is_served_to_no_one_meanwhile() {
    let Some((_etcd, _dir, h0, h1)) = two_hosts() else {
        return;
    };
    put(&h0, "k", &[1u8; 5000]).expect("stored on h0");
    eventually("h1 serves ns/k", || get(&h1, "k").is_some());
    assert!(indexed(&h1, "k"));
    let checked = Arc::new(AtomicBool::new(false));
    let (done, me, there) = (checked.clone(), Arc::downgrade(&h1), h0.clone());
    h1.set_ask_gate(Some(Box::new(move |at, ns, key| {
        if (at, ns, key) != ("withdrawn", "ns", "k") || done.load(Ordering::SeqCst) {
            return;
        }
        // h1's removal is in etcd; once h1 has filed a later entry of h0's, its applier has
        // come to the removal too, and held it back.
        put(&there, "marker", b"m").expect("marker");
        let h1 = me.upgrade().expect("the host stopped");
        eventually("h1 serves ns/marker", || get(&h1, "marker").is_some());
        assert_eq!(get(&h1, "k"), None, "a new reader got the removed entry");
        assert!(
            !indexed(&h1, "k"),
            "the index still names the removed entry"
        );
        done.store(true, Ordering::SeqCst);
    })));
    let deleted = h1
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    assert!(checked.load(Ordering::SeqCst), "the seam ran");
    h1.set_ask_gate(None);
    eventually("h0 drops ns/k", || get(&h0, "k").is_none());
    assert_eq!(get(&h1, "k"), None);
    // The name stored again: both serve it.
    put(&h0, "k", &[2u8; 3000]).expect("stored again on h0");
    eventually("h1 serves the new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [2u8; 3000])
    });
    assert!(indexed(&h1, "k"));
}

/// A claim of a fresh region that reaches etcd after a rejoin — the host's lease gone while
/// the region was already the store's, and claimed again for it by the rejoin under the new
/// lease — comes back refused (taken: by this host). The region leaves the host, and its
/// claim in etcd goes too (CI's seed 5 of the partitions: etcd kept the region for the host
/// as long as it lived, and no host could carve it).
#[test]
fn a_claim_refused_after_a_rejoin_claimed_its_region_leaves_no_claim_in_etcd() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (h0, auth) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    let rt = Arc::new(tokio::runtime::Runtime::new().expect("a runtime"));
    let etcd_client = {
        let _in = rt.enter();
        maru_cluster::etcd::Client::connect(&etcd.endpoints(), Default::default())
            .expect("an etcd client")
    };
    // The lease of h0's node record, and the holders of the claimed units (by offset).
    let node_key = format!("/maru/{uuid}/nodes/h0");
    let lease = {
        let (c, key) = (etcd_client.clone(), node_key.clone());
        move |rt: &tokio::runtime::Runtime| {
            let r = rt
                .block_on(c.get(key.clone(), Range::KEY))
                .expect("the node record");
            r.kvs.first().map(|kv| kv.lease)
        }
    };
    let claims = {
        let (c, prefix) = (etcd_client.clone(), format!("/maru/{uuid}/regions/"));
        move |rt: &tokio::runtime::Runtime| -> Vec<(u64, String)> {
            let r = rt
                .block_on(c.get(prefix.clone(), Range::PREFIX))
                .expect("the claims");
            r.kvs
                .iter()
                .map(|kv| {
                    let hex = String::from_utf8_lossy(&kv.key[prefix.len()..]).into_owned();
                    let unit = u64::from_str_radix(&hex, 16).expect("a unit index");
                    (unit * UNIT, String::from_utf8_lossy(&kv.value).into_owned())
                })
                .collect()
        }
    };
    let gated = Arc::new(std::sync::Mutex::new(None));
    let (seen, me, rt_g) = (gated.clone(), Arc::downgrade(&auth), rt.clone());
    let (lease_g, claims_g) = (lease.clone(), claims.clone());
    auth.set_claim_gate(Some(Box::new(move |offset| {
        let mut seen = seen.lock().expect("lock");
        if seen.is_some() {
            return;
        }
        *seen = Some(offset);
        // The lease goes (as when the host is cut off past its TTL), and the host rejoins:
        // the region is the store's already, so the rejoin claims it again.
        let rt = &rt_g;
        let old = lease_g(rt).expect("h0 has a lease");
        rt.block_on(etcd_client.lease_revoke(old))
            .expect("revoking h0's lease");
        eventually("h0 rejoins and claims its region again", || {
            lease_g(rt).is_some_and(|l| l != old)
                && claims_g(rt).contains(&(offset, "h0".to_owned()))
                && me.upgrade().is_some_and(|a| !a.fenced())
        });
    })));
    // The store's first allocation claims a region; the claim is refused, and the store
    // places the entry in another region, or fails.
    let stored = put(&h0, "k", &[1u8; 5000]);
    auth.set_claim_gate(None);
    let offset = gated.lock().expect("lock").expect("the seam ran");
    assert!(
        !auth.regions(&uuid).iter().any(|&(o, _)| o == offset),
        "the refused region stays the store's"
    );
    eventually("etcd lets go of the refused region", || {
        !claims(&rt).iter().any(|(o, _)| *o == offset)
    });
    // Nothing else is lost: what the store holds is what etcd says it holds.
    if stored.is_ok() {
        h0.delete(&Caller::root(), "ns", &["k".to_owned()])
            .expect("delete");
    }
    eventually("etcd's claims are the store's", || {
        let mut here: Vec<u64> = auth.regions(&uuid).iter().map(|&(o, _)| o).collect();
        let mut there: Vec<u64> = claims(&rt).into_iter().map(|(o, _)| o).collect();
        here.sort_unstable();
        there.sort_unstable();
        here == there
    });
}
