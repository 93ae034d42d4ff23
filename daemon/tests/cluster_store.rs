//! In-process tests of the store in cluster mode: two stores (two hosts) sharing one `file:`
//! pool and a private etcd, each with its authority and applier as marud runs them, and the
//! store's seams to stop a host at a chosen step.
//!
//! Needs Debian's `etcd-server` (skipped without it, unless `MARU_REQUIRE_ROOT` is set).

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use maru::proto::Located;
use maru_cluster::UNIT;
use maru_cluster::etcd::Range;
use maru_cluster::testing::Etcd;
use maru_daemon::cluster::applier::start_applier;
use maru_daemon::cluster::{ClusterSettings, EtcdAuthority};
use maru_daemon::pool::PoolSpec;
use maru_daemon::store::authority::Authority;
use maru_daemon::store::publishing::Publish;
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
    host_at(etcd.endpoints(), dir, node, uuid)
}

/// [`host_and_authority`], reaching etcd at `endpoints`.
fn host_at(
    endpoints: Vec<String>,
    dir: &Path,
    node: &str,
    uuid: &str,
) -> (Arc<Store>, Arc<EtcdAuthority>) {
    let settings = ClusterSettings {
        endpoints,
        node: node.to_owned(),
        ttl: Duration::from_secs(10),
        orphans_after: Duration::from_secs(300),
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

/// What `f` makes of where `store` serves `ns/key` (None: absent).
fn served<T>(store: &Store, key: &str, f: impl FnOnce(&Located) -> T) -> Option<T> {
    let s = store.open_session("t", Caller::root());
    let found = store
        .retrieve(s, "ns", &[key.to_owned()], |_| false)
        .expect("retrieve")
        .pop()
        .expect("one answer")
        .map(|(loc, _)| f(&loc));
    store.close_session(s);
    found
}

/// The bytes `store` serves as `ns/key` (None: absent).
fn get(store: &Store, key: &str) -> Option<Vec<u8>> {
    served(store, key, |loc| {
        let mut b = vec![0; loc.size as usize];
        store
            .raw_pool_fd(loc.pool, false)
            .and_then(|f| Ok(f.read_exact_at(&mut b, loc.offset)?))
            .expect("reading the pool");
        b
    })
}

/// Where `store` serves `ns/key` in the pool (None: absent).
fn offset_of(store: &Store, key: &str) -> Option<u64> {
    served(store, key, |loc| loc.offset)
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
/// One host, h0, with its authority, on a fresh pool (its UUID) and a private etcd.
#[allow(clippy::type_complexity)]
fn one_host() -> Option<(
    Etcd,
    tempfile::TempDir,
    String,
    Arc<Store>,
    Arc<EtcdAuthority>,
)> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (h0, auth) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    Some((etcd, dir, uuid, h0, auth))
}

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
    t.lookup(key.as_bytes()).expect("no slot stuck").is_some()
}

/// Deletes `ns/k` on `here`, the delete stopped once, its removal in etcd, while `there`
/// stores `ns/marker` and `here` serves it: `here`'s applier has then come to the removal
/// too, and held it back for the delete. Then runs `check` on `here`, the delete still
/// stopped, and lets the delete finish.
fn delete_k_while_its_removal_is_held_back(
    here: &Arc<Store>,
    there: &Arc<Store>,
    check: impl Fn(&Store) + Send + Sync + 'static,
) {
    let checked = Arc::new(AtomicBool::new(false));
    let (done, me, there) = (checked.clone(), Arc::downgrade(here), there.clone());
    here.set_ask_gate(Some(Box::new(move |at, ns, key| {
        if (at, ns, key) != ("withdrawn", "ns", "k") || done.load(Ordering::SeqCst) {
            return;
        }
        put(&there, "marker", b"m").expect("marker");
        let here = me.upgrade().expect("the host stopped");
        eventually("the stopped host serves ns/marker", || {
            get(&here, "marker").is_some()
        });
        check(&here);
        done.store(true, Ordering::SeqCst);
    })));
    let deleted = here
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    here.set_ask_gate(None);
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    assert!(checked.load(Ordering::SeqCst), "the seam ran");
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
    delete_k_while_its_removal_is_held_back(&h1, &h0, |h1| {
        assert_eq!(get(h1, "k"), None, "a new reader got the removed entry");
        assert!(!indexed(h1, "k"), "the index still names the removed entry");
    });
    eventually("h0 drops ns/k", || get(&h0, "k").is_none());
    assert_eq!(get(&h1, "k"), None);
    // The name stored again: both serve it.
    put(&h0, "k", &[2u8; 3000]).expect("stored again on h0");
    eventually("h1 serves the new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [2u8; 3000])
    });
    assert!(indexed(&h1, "k"));
}

/// The twin of the test above for an entry of this host's own: its removal by another host
/// waits here for this host's own delete of it to settle, and meanwhile the entry is refused
/// to new readers and out of the index (seed 2423: h2's entry, removed while h2 was cut off,
/// in a region another host took then, was served after h2's rejoin from its extent carved
/// again, while a client of h2's deleted it through the mount).
#[test]
fn a_removal_of_an_own_entry_held_back_for_a_delete_here_is_served_to_no_one_meanwhile() {
    let Some((_etcd, _dir, h0, h1)) = two_hosts() else {
        return;
    };
    put(&h0, "k", &[1u8; 5000]).expect("stored on h0");
    eventually("h1 serves ns/k", || get(&h1, "k").is_some());
    assert!(indexed(&h0, "k"));
    delete_k_while_its_removal_is_held_back(&h0, &h1, |h0| {
        assert_eq!(get(h0, "k"), None, "a new reader got the removed entry");
        assert!(!indexed(h0, "k"), "the index still names the removed entry");
    });
    assert_eq!(get(&h0, "k"), None);
    eventually("h1 drops ns/k", || get(&h1, "k").is_none());
    // The name stored again: both serve it.
    put(&h0, "k", &[2u8; 3000]).expect("stored again on h0");
    assert_eq!(get(&h0, "k"), Some(vec![2u8; 3000]));
    eventually("h1 serves the new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [2u8; 3000])
    });
}

/// Stores each of `items` (name, bytes) through `store`, published together: one group
/// commit, one transaction, so one creation revision for all.
fn put_together(store: &Store, items: &[(&str, &[u8])]) {
    let s = store.open_session("t", Caller::root());
    let mut ids = Vec::new();
    for (_, data) in items {
        let (g, _) = store
            .alloc(s, data.len() as u64, 1, None, None)
            .expect("alloc")
            .pop()
            .expect("one grant");
        store
            .raw_pool_fd(g.pool, true)
            .and_then(|f| Ok(f.write_all_at(data, g.offset)?))
            .expect("writing the pool");
        ids.push(g.alloc);
    }
    let publications: Vec<Publish<'_>> = items
        .iter()
        .zip(ids)
        .map(|((key, _), id)| Publish {
            id,
            ns: "ns",
            key,
            len: None,
        })
        .collect();
    let out = store.publish_many(s, &publications);
    store.close_session(s);
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// Seed 1726: entries published in one transaction share their creation revision, and a
/// host told its entries apart by that revision alone. The removal of one, held back on a
/// host changing its name, refused the other to every reader of that host (h2 answered
/// NotFound for an entry every host listed, after the run). Here h1 deletes `ns/k`, one of two
/// entries h0 published together; while the removal waits on h1 for h1's own delete to settle,
/// h1 still serves the other.
#[test]
fn a_removal_held_back_refuses_no_reader_an_entry_published_with_the_removed_one() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let h0 = host(&etcd, dir.path(), "h0", &uuid);
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    put_together(&h0, &[("k", &[1u8; 5000]), ("sibling", &[2u8; 6000])]);
    let view = EtcdView::new(&etcd, &uuid);
    assert_eq!(
        view.created("k"),
        view.created("sibling"),
        "published in one transaction"
    );
    eventually("h1 serves both", || {
        get(&h1, "k").is_some() && get(&h1, "sibling").is_some()
    });
    delete_k_while_its_removal_is_held_back(&h1, &h0, |h1| {
        assert_eq!(get(h1, "k"), None, "a new reader got the removed entry");
        assert_eq!(
            get(h1, "sibling"),
            Some(vec![2u8; 6000]),
            "the entry published with the removed one was refused"
        );
    });
    eventually("h0 drops ns/k", || get(&h0, "k").is_none());
    for h in [&h0, &h1] {
        assert_eq!(get(h, "sibling"), Some(vec![2u8; 6000]));
    }
}

/// What a test reads and writes in etcd directly: a host's lease, the regions' claims.
struct EtcdView {
    rt: tokio::runtime::Runtime,
    client: maru_cluster::etcd::Client,
    root: String,
}

impl EtcdView {
    fn new(etcd: &Etcd, uuid: &str) -> EtcdView {
        let rt = tokio::runtime::Runtime::new().expect("a runtime");
        let client = {
            let _in = rt.enter();
            maru_cluster::etcd::Client::connect(&etcd.endpoints(), Default::default())
                .expect("an etcd client")
        };
        EtcdView {
            rt,
            client,
            root: format!("/maru/{uuid}/"),
        }
    }

    /// The lease of `node`'s record, if it has one.
    fn lease(&self, node: &str) -> Option<i64> {
        let key = format!("{}nodes/{node}", self.root);
        let r = self.rt.block_on(self.client.get(key, Range::KEY));
        r.expect("the node record").kvs.first().map(|kv| kv.lease)
    }

    /// Whether etcd holds an entry `ns/key`.
    fn has_entry(&self, key: &str) -> bool {
        self.has(&format!("entries/ns/{key}"))
    }

    /// Whether a host holds a reservation of `ns/key`.
    fn has_reservation(&self, key: &str) -> bool {
        self.has(&format!("reserved/ns/{key}"))
    }

    fn has(&self, key: &str) -> bool {
        let key = format!("{}{key}", self.root);
        let r = self.rt.block_on(self.client.get(key, Range::KEY));
        !r.expect("the key").kvs.is_empty()
    }

    /// The revision that created entry `ns/key`.
    fn created(&self, key: &str) -> i64 {
        let key = format!("{}entries/ns/{key}", self.root);
        let r = self.rt.block_on(self.client.get(key, Range::KEY));
        r.expect("the entry")
            .kvs
            .first()
            .expect("an entry")
            .create_revision
    }

    /// The keys under `dir` of the pool's root (the rest of each key), with their values.
    fn under(&self, dir: &str) -> Vec<(String, String)> {
        let prefix = format!("{}{dir}", self.root);
        let r = self
            .rt
            .block_on(self.client.get(prefix.clone(), Range::PREFIX));
        r.unwrap_or_else(|e| panic!("reading {dir}: {e}"))
            .kvs
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(&kv.key[prefix.len()..]).into_owned(),
                    String::from_utf8_lossy(&kv.value).into_owned(),
                )
            })
            .collect()
    }

    /// The client pins recorded: `ns/key/node` each.
    fn client_pins(&self) -> Vec<String> {
        self.under("clientpins/")
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    /// Revokes `lease` (as etcd does once a host cut off outlives its TTL).
    fn revoke(&self, lease: i64) {
        let r = self.rt.block_on(self.client.lease_revoke(lease));
        r.expect("revoking a lease");
    }

    /// The claimed regions: offset of each unit, and its holder.
    fn claims(&self) -> Vec<(u64, String)> {
        self.under("regions/")
            .into_iter()
            .map(|(hex, holder)| {
                let unit = u64::from_str_radix(&hex, 16).expect("a unit index");
                (unit * UNIT, holder)
            })
            .collect()
    }

    /// Claims the unit at `offset` for `node` behind the hosts' backs (or takes the claim
    /// back): another host's claim, made while this one was cut off.
    fn set_claim(&self, offset: u64, node: Option<&str>) {
        let key = format!("{}regions/{:016x}", self.root, offset / UNIT);
        let r = match node {
            Some(n) => self.rt.block_on(self.client.put(key, n, 0)).map(drop),
            None => self.rt.block_on(self.client.delete(key)).map(drop),
        };
        r.expect("writing a claim");
    }

    /// Revokes `node`'s lease, and waits until it has rejoined, claimed `offset` again (for
    /// itself, or found it taken) and read every entry afresh (`auth` is no longer fenced).
    fn cut_and_rejoin(&self, node: &str, auth: &EtcdAuthority, offset: u64, holder: &str) {
        let old = self.lease(node).expect("the host has a lease");
        self.revoke(old);
        eventually("the host rejoins", || {
            self.lease(node).is_some_and(|l| l != old)
                && self.claims().contains(&(offset, holder.to_owned()))
                && !auth.fenced()
        });
    }

    /// Waits until etcd's claims are exactly the regions `auth`'s store holds.
    fn claims_match(&self, auth: &EtcdAuthority, pool: &str) {
        eventually("etcd's claims are the store's regions", || {
            let mut here: Vec<u64> = auth.regions(pool).iter().map(|&(o, _)| o).collect();
            let mut there: Vec<u64> = self.claims().into_iter().map(|(o, _)| o).collect();
            here.sort_unstable();
            there.sort_unstable();
            here == there
        });
    }
}

/// Installs on `auth` a seam that runs `f` once, before the first claim of a fresh region
/// goes to etcd; the region's offset, once it ran.
fn before_first_claim(
    auth: &EtcdAuthority,
    f: impl Fn(u64) + Send + Sync + 'static,
) -> Arc<std::sync::Mutex<Option<u64>>> {
    let gated = Arc::new(std::sync::Mutex::new(None));
    let seen = gated.clone();
    auth.set_claim_gate(Some(Box::new(move |offset| {
        let mut seen = seen.lock().expect("lock");
        if seen.is_none() {
            *seen = Some(offset);
            f(offset);
        }
    })));
    gated
}

/// One host whose first claim of a fresh region reached etcd after a rejoin: the seam before
/// it revoked the host's lease (after `taker`, if any, claimed the region behind its back)
/// and waited for the host to rejoin, which claimed the region again for itself (or found it
/// the taker's and marked it lost); the claim itself was then refused.
struct ClaimedAcrossARejoin {
    h0: Arc<Store>,
    auth: Arc<EtcdAuthority>,
    view: Arc<EtcdView>,
    uuid: String,
    /// The region's offset.
    offset: u64,
    /// The store that claimed it (placed elsewhere after the refusal, or failed).
    stored: maru::Result<()>,
    _dir: tempfile::TempDir,
    _etcd: Etcd,
}

fn claimed_across_a_rejoin(taker: Option<&'static str>) -> Option<ClaimedAcrossARejoin> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (h0, auth) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    let view = Arc::new(EtcdView::new(&etcd, &uuid));
    let (v, a) = (view.clone(), Arc::downgrade(&auth));
    let gated = before_first_claim(&auth, move |offset| {
        if let Some(t) = taker {
            v.set_claim(offset, Some(t));
        }
        let a = a.upgrade().expect("the host");
        v.cut_and_rejoin("h0", &a, offset, taker.unwrap_or("h0"));
    });
    let stored = put(&h0, "k", &[1u8; 5000]);
    auth.set_claim_gate(None);
    let offset = gated.lock().expect("lock").expect("the seam ran");
    assert!(
        !auth.regions(&uuid).iter().any(|&(o, _)| o == offset),
        "the refused region stays the store's"
    );
    Some(ClaimedAcrossARejoin {
        h0,
        auth,
        view,
        uuid,
        offset,
        stored,
        _dir: dir,
        _etcd: etcd,
    })
}

/// A claim of a fresh region that reaches etcd after a rejoin — the host's lease gone while
/// the region was already the store's, and claimed again for it by the rejoin under the new
/// lease — comes back refused (taken: by this host). The region leaves the host, and its
/// claim in etcd goes too (CI's seed 5 of the partitions: etcd kept the region for the host
/// as long as it lived, and no host could carve it).
#[test]
fn a_claim_refused_after_a_rejoin_claimed_its_region_leaves_no_claim_in_etcd() {
    let Some(c) = claimed_across_a_rejoin(None) else {
        return;
    };
    eventually("etcd lets go of the refused region", || {
        !c.view.claims().iter().any(|(o, _)| *o == c.offset)
    });
    // Nothing else is lost: what the store holds is what etcd says it holds.
    if c.stored.is_ok() {
        c.h0.delete(&Caller::root(), "ns", &["k".to_owned()])
            .expect("delete");
    }
    c.view.claims_match(&c.auth, &c.uuid);
}

/// A claim of a fresh region on its way across a rejoin that found the region taken by
/// another host (so it marked it lost: nothing more is placed there) comes back refused: the
/// region leaves with its mark. Claimed afresh later, used and emptied, it is given back to
/// etcd (seed 901: the mark stayed, the release was skipped as another host's, and etcd kept
/// the region for this host as long as it lived).
#[test]
fn a_region_marked_lost_by_a_rejoin_and_refused_is_given_back_when_claimed_again() {
    let Some(c) = claimed_across_a_rejoin(Some("h9")) else {
        return;
    };
    let (h0, auth, uuid, offset) = (&c.h0, &c.auth, &c.uuid, c.offset);
    // The other host lets go of it; h0 fills the pool until it claims the region afresh.
    c.view.set_claim(offset, None);
    let mut names = vec!["k".to_owned()];
    for i in 0.. {
        if auth.regions(uuid).iter().any(|&(o, _)| o == offset) {
            break;
        }
        assert!(i < 64, "h0 never claimed the region again");
        let name = format!("f{i}");
        put(h0, &name, &vec![2u8; 1 << 20]).expect("a store");
        names.push(name);
    }
    // Emptied, every region goes back: etcd holds none of them for h0.
    let _ = h0.delete(&Caller::root(), "ns", &names).expect("delete");
    eventually("h0 gives every region back", || {
        auth.regions(uuid).is_empty()
    });
    c.view.claims_match(auth, uuid);
}

/// A TCP relay to etcd on loopback: a host that reaches etcd through it can be cut off from
/// etcd (its connections dropped, new ones refused) and let through again, while every other
/// host goes on.
struct Relay {
    endpoint: String,
    cut: Arc<AtomicBool>,
    open: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Relay {
    fn to(etcd: &Etcd) -> Relay {
        let upstream = etcd.endpoints()[0].trim_start_matches("http://").to_owned();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a relay port");
        let endpoint = format!("http://{}", listener.local_addr().expect("its address"));
        let cut = Arc::new(AtomicBool::new(false));
        let open = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, o) = (cut.clone(), open.clone());
        // Lives as long as the test's process: it only ever waits in accept.
        std::thread::spawn(move || {
            for inbound in listener.incoming() {
                let Ok(inbound) = inbound else { continue };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                let Ok(out) = std::net::TcpStream::connect(&upstream) else {
                    continue;
                };
                let pair = [&inbound, &out].map(|s| s.try_clone().expect("a socket's clone"));
                o.lock().expect("lock").extend(pair);
                for (mut from, mut to) in [
                    (
                        inbound.try_clone().expect("clone"),
                        out.try_clone().expect("clone"),
                    ),
                    (out, inbound),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Relay {
            endpoint,
            cut,
            open,
        }
    }

    /// Cuts the hosts behind the relay off etcd (`true`), or lets them through again.
    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            for s in self.open.lock().expect("lock").drain(..) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// An entry of this host's that another host removed while this host's watch was down is
/// found gone by the host's next read of every entry; its extent waits for every live host's
/// acknowledgement of the removal, which they gave at the removal's own revision, not at the
/// read's: the host frees the extent and gives its region back though no entry changes after
/// (seed 925: h1 waited for acknowledgements at its read's revision, which no host gave once
/// the entries stopped changing, and kept 10 MiB of regions).
#[test]
fn an_own_entry_found_removed_by_a_read_of_every_entry_is_freed_once_the_removal_is_acknowledged() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let relay = Relay::to(&etcd);
    let (h0, _) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    let (h1, a1) = host_at(vec![relay.endpoint.clone()], dir.path(), "h1", &uuid);
    put(&h1, "k", &[7u8; 5000]).expect("h1 stores ns/k");
    eventually("h0 serves h1's ns/k", || get(&h0, "k").is_some());
    assert!(!a1.regions(&uuid).is_empty(), "h1 holds the entry's region");
    // h1's watch goes down; h0 removes the entry meanwhile (and acknowledges the removal).
    relay.set_cut(true);
    h0.delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("h0 deletes ns/k");
    std::thread::sleep(Duration::from_secs(2));
    relay.set_cut(false);
    eventually(
        "h1 frees the removed extent and gives its region back",
        || a1.regions(&uuid).is_empty(),
    );
    EtcdView::new(&etcd, &uuid).claims_match(&a1, &uuid);
}

/// This host deletes its entry while another host deletes it too, the other first: this
/// host's removal finds the entry gone and joins the other's, whose revision every live host
/// acknowledges as it applies it. This host frees the extent and gives its region back,
/// though nothing is removed after (it waited for the revision of its own failed
/// transaction, after the other's, which no host acknowledges until some later removal, and
/// kept the region for as long as the cluster removed nothing more).
#[test]
fn an_own_entry_deleted_here_and_elsewhere_at_once_is_freed_without_a_later_removal() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (h0, a0) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    put(&h0, "k", &[7u8; 5000]).expect("h0 stores ns/k");
    eventually("h1 serves h0's ns/k", || get(&h1, "k").is_some());
    assert!(!a0.regions(&uuid).is_empty(), "h0 holds the entry's region");
    // h0's removal waits at the seam while h1 deletes the entry, then stores another (a
    // change after h1's removal, as acknowledgements and renewals make too).
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    a0.set_removal_gate(Some(gate.clone()));
    let h = h0.clone();
    let deleting = std::thread::spawn(move || h.delete(&Caller::root(), "ns", &["k".to_owned()]));
    std::thread::sleep(Duration::from_millis(500));
    let deleted = h1
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete on h1");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    put(&h1, "other", &[8u8; 3000]).expect("h1 stores ns/other");
    gate.add_permits(1);
    let out = deleting
        .join()
        .expect("the delete's thread")
        .expect("delete on h0");
    a0.set_removal_gate(None);
    assert_eq!(
        gate.available_permits(),
        0,
        "h0's removal went to etcd, after h1's"
    );
    assert!(
        matches!(out[..], [Err(maru::Error::NotFound(_))]),
        "h1 removed it first: {out:?}"
    );
    assert_eq!(get(&h0, "k"), None);
    eventually(
        "h0 frees the removed extent and gives its region back",
        || a0.regions(&uuid).is_empty(),
    );
}

/// A writer through the mount reads back what it committed (closed) in the shared pool only
/// once it is published: until then its publication may yet fail (the name's reservation
/// goes with a lost lease, and another host may take the name), so its writer, like any
/// other reader, waits for it and is told it is not there if it does not come (seed 963: a
/// writer cut off read back its own bytes, never published, then another host's entry of the
/// name). Before its close, the writer sees its file.
#[test]
fn a_writer_reads_back_an_entry_of_the_shared_pool_once_it_is_published() {
    use maru_fsd::Backend;
    let Some((_etcd, _dir, h0, _h1)) = two_hosts() else {
        return;
    };
    let (fs, me, ns, ino) = mount_writer(&h0, "k", b"the bytes of k");
    assert_eq!(
        fs.lookup(&me, ns, "k").expect("its writer sees it").ino,
        ino
    );
    fs.commit(&me, ino, false).expect("close");
    // Committed, not published: its writer still sees the name (stat, rename, unlink), but
    // does not read bytes that may never be published.
    assert_eq!(
        fs.lookup(&me, ns, "k").expect("its writer sees it").ino,
        ino
    );
    assert!(matches!(
        fs.open(&me, ino, false),
        Err(maru::Error::NotFound(_))
    ));
    // Published while its writer waits: it reads the entry.
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            fs.seal(ino).expect("published");
        });
        assert!(fs.open(&me, ino, false).is_ok(), "published");
    });
    assert_eq!(get(&h0, "k").as_deref(), Some(&b"the bytes of k"[..]));
}

/// A host that comes and goes: a bare member of the cluster as `node` claims the region at
/// `region`, publishes `ns/name` there (4 KiB at `offset`), and leaves (its lease revoked,
/// its claim with it; the entry stays).
fn come_and_go(etcd: &Etcd, uuid: &str, node: &str, (region, offset): (u64, u64), name: &str) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let info = maru_cluster::NodeInfo {
            node: node.into(),
            address: "127.0.0.1".into(),
            pid: std::process::id(),
        };
        let m = maru_cluster::Member::join(&etcd.endpoints(), uuid, info, Duration::from_secs(10))
            .await
            .expect("join");
        assert!(m.claim(region, UNIT).await.expect("claim").is_some());
        let record = maru_cluster::EntryRecord {
            offset,
            len: 4096,
            node: node.into(),
            alloc: 1,
        };
        let r = m.publish("ns", name, &record).await.expect("publish");
        assert!(matches!(r, maru_cluster::Published::New { .. }), "{r:?}");
        m.leave().await.expect("leave");
    });
}

/// Seed 1462 of the fault harness: a host whose entry watch lagged (stuck on an etcd member
/// cut off from the others) claimed a region whose last holder, cut off in turn and its
/// lease ended, had published an entry there that the lagging host had not seen, and wrote
/// over it. A claim now waits until the watch has delivered its own revision, and gives back
/// a region where another host's entry lives. Here the last holder is a bare member that
/// claims the pool's first region, publishes there while the host's watch is held back, and
/// leaves; the host, storing, carves that region first.
#[test]
fn a_host_whose_watch_lags_claims_no_region_over_an_entry_it_has_not_seen() {
    let Some((etcd, _dir, uuid, h0, auth)) = one_host() else {
        return;
    };
    auth.hold_watch(true);
    come_and_go(&etcd, &uuid, "gone", (UNIT, UNIT), "theirs");
    // The watch catches up half a second into the claim's wait.
    let opener = {
        let auth = auth.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            auth.hold_watch(false);
        })
    };
    put(&h0, "mine", &[7u8; 4096]).expect("store");
    opener.join().expect("opener");
    let at = offset_of(&h0, "mine").expect("h0 serves its entry");
    assert!(
        !(UNIT..2 * UNIT).contains(&at),
        "h0 placed its entry at {at:#x}, in the region of another host's entry"
    );
    eventually("h0 serves the other host's entry", || {
        offset_of(&h0, "theirs") == Some(UNIT)
    });
}

/// Seed 1495 of the fault harness: a host whose entry watch lagged by seconds went on serving
/// an entry another host had deleted. A renewal of its lease now counts only once its tick
/// has come back through the watch: a host whose watch is held back is fenced off within
/// the lease's validity, and serves again once the watch has caught up (the deletion then
/// applied).
#[test]
fn a_host_whose_watch_lags_serves_no_entry_deleted_elsewhere() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let h0 = host(&etcd, dir.path(), "h0", &uuid);
    let (h1, auth) = host_and_authority(&etcd, dir.path(), "h1", &uuid);
    put(&h0, "k", &[1u8; 4096]).expect("store");
    eventually("h1 serves ns/k", || get(&h1, "k").is_some());
    auth.hold_watch(true);
    let deleted = h0
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    let t = Instant::now();
    eventually("h1 stops serving ns/k, deleted on h0", || {
        get(&h1, "k").is_none()
    });
    // Within the validity of the renewal before the hold (TTL 10 s, less its guard).
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(auth.fenced(), "h1 serves nothing while its view lags");
    auth.hold_watch(false);
    eventually("h1 serves again", || !auth.fenced());
    assert_eq!(get(&h1, "k"), None);
    put(&h0, "k", &[2u8; 100]).expect("stored again");
    eventually("h1 serves the new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [2u8; 100])
    });
}

/// A region of this host's that another host claimed, wrote in and lost while this one was
/// cut off (the cut ended this host's lease and its claims), and that the rejoin claims
/// again because it is free by then, is marked lost once the host's read of every entry
/// shows the other host's entry there. A write of this host's in flight across the cut, at
/// the extent the other host then used, is not published (two live entries would share the
/// extent, and the bytes are the other host's); nothing more is placed in the region; the
/// other host's entry and this host's earlier one are served whole; and the region, once
/// emptied of this host's entries, is given back to etcd.
#[test]
fn a_region_claimed_again_by_a_rejoin_over_another_host_s_entry_is_marked_lost() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let relay = Relay::to(&etcd);
    let (h0, auth) = host_at(vec![relay.endpoint.clone()], dir.path(), "h0", &uuid);
    let view = EtcdView::new(&etcd, &uuid);
    put(&h0, "k", &[1u8; 5000]).expect("h0 stores ns/k");
    // A write of h0's, granted in a region of h0's and not yet published.
    let s = h0.open_session("t", Caller::root());
    let (g, _) = h0
        .alloc(s, 4096, 1, None, None)
        .expect("alloc")
        .pop()
        .expect("one grant");
    let region = g.offset / UNIT * UNIT;
    let pool = h0.raw_pool_fd(g.pool, true).expect("the pool");
    pool.write_all_at(&[3u8; 4096], g.offset)
        .expect("h0's bytes");
    // h0 is cut off, and its lease ends (as etcd ends it once the TTL has passed).
    relay.set_cut(true);
    let old = view.lease("h0").expect("h0's lease");
    view.revoke(old);
    // Meanwhile another host claims the region (nothing published in it is at that extent),
    // writes and publishes an entry at the extent h0 is writing, and goes in turn.
    pool.write_all_at(&[9u8; 4096], g.offset)
        .expect("the other host's bytes");
    come_and_go(&etcd, &uuid, "h9", (region, g.offset), "theirs");
    relay.set_cut(false);
    eventually("h0 rejoins and holds its region again", || {
        view.lease("h0").is_some_and(|l| l != old)
            && view.claims().contains(&(region, "h0".to_owned()))
            && !auth.fenced()
    });
    let mine = h0.publish(s, g.alloc, "ns", "mine", None);
    h0.close_session(s);
    assert!(
        mine.is_err(),
        "h0 published its write at the extent of another host's entry"
    );
    assert_eq!(get(&h0, "mine"), None);
    for i in 0..16 {
        let name = format!("new{i}");
        put(&h0, &name, &[2u8; 64 << 10]).expect("h0 stores after the rejoin");
        let at = offset_of(&h0, &name).expect("h0 serves what it stored");
        assert!(
            !(region..region + UNIT).contains(&at),
            "h0 placed ns/{name} at {at:#x}, in the region marked lost"
        );
    }
    assert_eq!(get(&h0, "theirs"), Some(vec![9u8; 4096]));
    assert_eq!(get(&h0, "k"), Some(vec![1u8; 5000]));
    // Emptied of this host's entries, the region is given back: etcd holds for h0 exactly
    // the regions its store holds (the release of a region marked lost was skipped as
    // another host's, though the claim was h0's: etcd kept it as long as h0 lived).
    assert!(!auth.regions(&uuid).iter().any(|&(o, _)| o == region));
    view.claims_match(&auth, &uuid);
}

/// Seed 1591 of the fault harness: a host killed just after etcd took its publication of an
/// entry (before its store recorded it) came back without it, while the other hosts served
/// it; the restarted host then claimed the entry's region as empty, and wrote over it. An
/// entry of this node that the run did not recover now counts as another host's: the claim
/// of its region is given back, and the host serves the entry too. Here the earlier run is
/// a bare member of the node's name that claims the pool's first region (which the host,
/// storing, carves first), publishes there and leaves.
#[test]
fn a_restarted_host_claims_no_region_over_an_entry_its_earlier_run_published() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("cxl.img"))
        .and_then(|f| f.write_all_at(&[5u8; 4096], UNIT))
        .expect("the earlier run's bytes");
    come_and_go(&etcd, &uuid, "h0", (UNIT, UNIT), "earlier");
    let h0 = host(&etcd, dir.path(), "h0", &uuid);
    put(&h0, "mine", &[7u8; 4096]).expect("store");
    let at = offset_of(&h0, "mine").expect("h0 serves its entry");
    assert!(
        !(UNIT..2 * UNIT).contains(&at),
        "h0 placed its entry at {at:#x}, in the region of its earlier run's entry"
    );
    eventually("h0 serves its earlier run's entry", || {
        get(&h0, "earlier").is_some_and(|b| b == [5u8; 4096])
    });
}

/// Seed 1657 of the fault harness: a publication etcd had taken was acknowledged 2.03 s
/// after its host was cut off, past the host's fence, because the group commit answered it
/// only once the removals beside it were done, and their transaction, sent as the cut came,
/// waited out its timeout. Each kind is answered as soon as its own transactions are. Here
/// the seam holds a commit's removals: one removal alone first, so that a publication and a
/// removal queue behind it and go to etcd in the next commit together; that commit's removal
/// is held in turn, and its publication must be answered meanwhile.
#[test]
fn a_publication_is_answered_while_a_removal_of_its_commit_waits() {
    let Some((etcd, _dir, uuid, h0, auth)) = one_host() else {
        return;
    };
    for key in ["first", "second"] {
        put(&h0, key, &[1u8; 5000]).expect("h0 stores");
    }
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    auth.set_removal_gate(Some(gate.clone()));
    let delete = |key: &'static str| {
        let h = h0.clone();
        std::thread::spawn(move || h.delete(&Caller::root(), "ns", &[key.to_owned()]))
    };
    let first = delete("first");
    std::thread::sleep(Duration::from_millis(500));
    let (published_tx, published) = std::sync::mpsc::channel();
    let h = h0.clone();
    let publication = std::thread::spawn(move || {
        let r = put(&h, "new", &[2u8; 5000]);
        let _ = published_tx.send(());
        r
    });
    let second = delete("second");
    // Both wait behind the first commit, held at the seam; let its removal go.
    std::thread::sleep(Duration::from_secs(1));
    gate.add_permits(1);
    let answered = published.recv_timeout(Duration::from_secs(20));
    let second_waits = !second.is_finished();
    gate.add_permits(1);
    assert!(
        answered.is_ok(),
        "the publication waited for the removal of its commit"
    );
    assert!(
        second_waits,
        "the second removal was not held: it did not go in the publication's commit"
    );
    publication
        .join()
        .expect("the publication's thread")
        .expect("h0 stores ns/new");
    for removal in [first, second] {
        let out = removal.join().expect("the removal's thread");
        assert!(out.is_ok_and(|each| each.iter().all(Result::is_ok)));
    }
    auth.set_removal_gate(None);
    assert_eq!(get(&h0, "new"), Some(vec![2u8; 5000]));
    assert_eq!(get(&h0, "second"), None);
    let view = EtcdView::new(&etcd, &uuid);
    assert!(view.has_entry("new") && !view.has_entry("first") && !view.has_entry("second"));
}

/// The region of h0's that holds `ns/key`'s extent.
fn region_of(store: &Store, auth: &EtcdAuthority, pool: &str, key: &str) -> (u64, u64) {
    let at = offset_of(store, key).expect("stored");
    auth.regions(pool)
        .into_iter()
        .find(|&(o, l)| (o..o + l).contains(&at))
        .expect("a region of h0's holds it")
}

/// Seed 1873: an emptied region's release reached an etcd member just cut off from the
/// others and waited there (2 s, its timeout), holding the releases' bookkeeping; the next
/// region emptied, given back under the store's lock, waited for that bookkeeping, and the
/// whole store with it: a store published before the cut was answered 2.07 s after it, past
/// the host's lease. Here the first release waits at a seam instead of etcd.
#[test]
fn a_region_s_release_waiting_for_etcd_holds_up_neither_the_store_nor_the_next_release() {
    let Some((etcd, _dir, uuid, h0, auth)) = one_host() else {
        return;
    };
    // Two entries of a unit, a region each, and a small one in a third region, with room.
    let unit = vec![3u8; UNIT as usize];
    put(&h0, "a", &unit).expect("h0 stores ns/a");
    put(&h0, "b", &unit).expect("h0 stores ns/b");
    put(&h0, "k", &[5u8; 5000]).expect("h0 stores ns/k");
    let [ra, rb, rk] = ["a", "b", "k"].map(|key| region_of(&h0, &auth, &uuid, key));
    assert!(ra != rb && rb != rk && ra != rk, "{ra:?} {rb:?} {rk:?}");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    auth.set_release_gate(Some(gate.clone()));
    let held = |r: (u64, u64)| auth.regions(&uuid).contains(&r);
    let delete = |key: &'static str| {
        let h = h0.clone();
        std::thread::spawn(move || h.delete(&Caller::root(), "ns", &[key.to_owned()]))
    };
    let deleted_a = delete("a");
    eventually("ns/a's region given back", || !held(ra));
    // Its release is at the seam now, in its turn at etcd. The next region goes back too.
    std::thread::sleep(Duration::from_millis(300));
    let deleted_b = delete("b");
    eventually("ns/b's region given back", || !held(rb));
    // Neither the store nor the thread that gave the region back waits for the first release:
    // reads are answered meanwhile. (A store that needs a fresh region waits, rightly: its
    // claim goes to etcd after the releases pending there.)
    let h = h0.clone();
    let (done, client) = on_a_thread(move || get(&h, "k"));
    let answered = done.recv_timeout(Duration::from_secs(20));
    let claims_meanwhile = EtcdView::new(&etcd, &uuid).claims();
    gate.add_permits(16);
    assert!(
        answered.is_ok(),
        "a read waited for a region's release held at etcd"
    );
    assert_eq!(
        client.join().expect("the client's thread"),
        Some(vec![5u8; 5000])
    );
    for deleted in [deleted_a, deleted_b] {
        let r = deleted.join().expect("the delete's thread");
        assert!(r.is_ok_and(|each| each.iter().all(Result::is_ok)));
    }
    // Both releases were still pending meanwhile, and both land once etcd takes them.
    for r in [ra, rb] {
        assert!(claims_meanwhile.iter().any(|(o, _)| *o == r.0), "{r:?}");
    }
    eventually("etcd dropped both claims", || {
        let claims = EtcdView::new(&etcd, &uuid).claims();
        [ra, rb]
            .iter()
            .all(|r| claims.iter().all(|(o, _)| *o != r.0))
    });
    auth.set_release_gate(None);
    put(&h0, "c", &unit).expect("h0 stores ns/c once the releases went");
}

/// Runs `f` on a thread of its own: the receiver is told once `f` returned, the thread's
/// join gives what it returned.
fn on_a_thread<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> (std::sync::mpsc::Receiver<()>, std::thread::JoinHandle<T>) {
    let (tx, returned) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let v = f();
        let _ = tx.send(());
        v
    });
    (returned, t)
}

/// A session of `store` that holds `keys` of `ns` in one call, on a thread of its own
/// ([`on_a_thread`]): the session and the hold's outcomes.
#[allow(clippy::type_complexity)]
fn hold_on_a_thread(
    store: &Arc<Store>,
    keys: &'static [&'static str],
) -> (
    std::sync::mpsc::Receiver<()>,
    std::thread::JoinHandle<(maru_daemon::store::SessionId, Vec<maru::Result<()>>)>,
) {
    let h = store.clone();
    on_a_thread(move || {
        let s = h.open_session("t", Caller::root());
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        (s, h.hold(s, "ns", &keys, true).expect("holding"))
    })
}

/// A client's first hold of another host's entry is recorded at etcd (for the publisher,
/// which alone evicts it) with the store's lock let go of: while the record waits, the
/// host's other clients are answered, and a second hold of the entry waits for the record's
/// outcome — it would count on it. A record that fails takes no hold: the second hold, the
/// first now, makes its own record.
#[test]
fn a_first_hold_of_another_host_s_entry_waiting_for_etcd_holds_up_no_other_client() {
    let Some((etcd, dir, uuid, h0, _auth0)) = one_host() else {
        return;
    };
    let (h1, auth1) = host_and_authority(&etcd, dir.path(), "h1", &uuid);
    put(&h0, "k", b"h0's entry").expect("h0 stores ns/k");
    put(&h1, "mine", b"h1's entry").expect("h1 stores ns/mine");
    eventually("h1 serves ns/k", || get(&h1, "k").is_some());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    auth1.set_pin_gate(Some(gate.clone()));
    // Twice in one call: neither is taken should the record fail.
    let (first_answered, first) = hold_on_a_thread(&h1, &["k", "k"]);
    // The first hold's record is at the seam now (it was not answered).
    assert!(
        first_answered
            .recv_timeout(Duration::from_millis(300))
            .is_err()
    );
    let h = h1.clone();
    let (read, reader) = on_a_thread(move || get(&h, "mine"));
    let read_meanwhile = read.recv_timeout(Duration::from_secs(20));
    let (second_answered, second) = hold_on_a_thread(&h1, &["k"]);
    let second_waited = second_answered
        .recv_timeout(Duration::from_millis(300))
        .is_err();
    // The record fails: etcd does not answer within the client's patience.
    etcd.pause(true);
    gate.add_permits(1);
    let (s1, r1) = first.join().expect("the first hold's thread");
    etcd.pause(false);
    gate.add_permits(16);
    let (s2, r2) = second.join().expect("the second hold's thread");
    assert!(
        read_meanwhile.is_ok(),
        "a read waited for a pin's record held at etcd"
    );
    assert_eq!(
        reader.join().expect("the reader's thread").as_deref(),
        Some(&b"h1's entry"[..])
    );
    assert!(
        second_waited,
        "a second hold did not wait for the first's record"
    );
    assert!(
        r1.iter().all(|r| matches!(r, Err(maru::Error::Busy(_)))),
        "{r1:?}"
    );
    assert!(r2.iter().all(Result::is_ok), "{r2:?}");
    // The failed record took no hold; the second's is recorded, for h1.
    let given_back = h1.hold(s1, "ns", &["k".to_owned()], false).expect("unhold");
    assert!(
        matches!(given_back[0], Err(maru::Error::NotFound(_))),
        "{given_back:?}"
    );
    let view = EtcdView::new(&etcd, &uuid);
    eventually("h1's client pin recorded", || {
        view.client_pins() == ["ns/k/h1".to_owned()]
    });
    // The last hold goes with its session, and the record with it.
    h1.close_session(s2);
    h1.close_session(s1);
    eventually("the client pin taken back", || {
        view.client_pins().is_empty()
    });
    auth1.set_pin_gate(None);
}

/// A name another host published and removed while this host's publication of it was on
/// its way: that host's entry, filed here before its removal (held back while this host
/// changes the name), gives way to the publication etcd granted here, never the reverse —
/// which answered the client `Exists` and freed the granted entry's extent while etcd kept
/// its record, so that the other hosts read the next entry's bytes under its name (seed
/// 1985).
#[test]
fn another_host_s_entry_filed_before_a_grant_here_gives_way_to_it() {
    let Some((etcd, _dir, uuid, h0, _auth)) = one_host() else {
        return;
    };
    file_another_host_s_k_once_granted(&h0, &uuid);
    let stored = put(&h0, "k", b"granted here");
    h0.set_ask_gate(None);
    stored.expect("the publication etcd granted is sealed");
    assert_eq!(get(&h0, "k").as_deref(), Some(&b"granted here"[..]));
    let view = EtcdView::new(&etcd, &uuid);
    assert!(view.has_entry("k"));
    deleted_everywhere(&h0, &view);
}

/// `ns/k`, which gave way here to another host's entry, is still this host's publication:
/// its delete removes etcd's record (a forgotten name was deleted here alone, its extent
/// freed while etcd kept the record: what the other hosts read there next, they read as it).
fn deleted_everywhere(h0: &Store, view: &EtcdView) {
    let deleted = h0
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    assert!(
        !view.has_entry("k"),
        "etcd kept the record of a deleted entry"
    );
}

/// The same through the mount: another host's entry of the name, filed before a writer's
/// publication granted here is sealed, gives way to it. The mount's seal files the new
/// entry over the name; the other stayed in the store's table under no name, its extent
/// adopted here for good, and its removal, when it came, found this host's entry instead.
#[test]
fn another_host_s_entry_filed_before_a_mount_writer_s_grant_gives_way_to_it() {
    use maru_fsd::Backend;
    let Some((etcd, _dir, uuid, h0, _auth)) = one_host() else {
        return;
    };
    file_another_host_s_k_once_granted(&h0, &uuid);
    let (fs, _, _, ino) = closed_mount_writer(&h0, "k", b"granted here");
    let sealed = fs.seal(ino);
    h0.set_ask_gate(None);
    sealed.expect("the publication etcd granted is sealed");
    assert_eq!(get(&h0, "k").as_deref(), Some(&b"granted here"[..]));
    assert!(EtcdView::new(&etcd, &uuid).has_entry("k"));
    // Gone, not left behind the new entry: filed under no name, its removal would find
    // this host's entry instead, and its extent would stay adopted here for good.
    let left = h0.remote_entries();
    assert!(
        left.is_empty(),
        "another host's entry left behind: {left:?}"
    );
    deleted_everywhere(&h0, &EtcdView::new(&etcd, &uuid));
}

/// A writer through the mount renamed after its close, before its publication: the new
/// name is reserved at etcd with the store's lock let go of (it was asked under it), and
/// the entry is published under it, the old name given back.
#[test]
fn a_mount_writer_renamed_after_its_close_is_published_under_its_new_name() {
    use maru_fsd::Backend;
    let Some((etcd, _dir, uuid, h0, _auth)) = one_host() else {
        return;
    };
    let (fs, caller, ns, ino) = closed_mount_writer(&h0, "k.tmp", b"renamed before sealed");
    fs.rename(&caller, ns, "k.tmp", ns, "k").expect("rename");
    fs.seal(ino).expect("published");
    assert_eq!(
        get(&h0, "k").as_deref(),
        Some(&b"renamed before sealed"[..])
    );
    assert!(get(&h0, "k.tmp").is_none());
    let view = EtcdView::new(&etcd, &uuid);
    assert!(view.has_entry("k"));
    assert!(!view.has_entry("k.tmp"));
    // The old name is free again, here and at etcd.
    put(&h0, "k.tmp", b"another").expect("the old name is free");
}

/// Another host's entry of a name, filed late here by a watch that lagged, over this host's
/// own entry of the name (published here after the other was deleted): its record stays
/// behind, and this host once took it for the truth when it deleted its own entry. Its
/// extent was freed at once, as if another host's, while the other hosts' clients still
/// mapped it. Now it waits for them as any removal of this host's does.
#[test]
fn a_late_record_of_another_host_s_entry_frees_nothing_of_this_host_s_before_its_readers_let_go() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (h0, a0) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    // h0's watch lags while h1 publishes ns/k and deletes it, and h0 publishes the name
    // (its bytes placed before: a region is claimed only with the watch caught up).
    let s0 = h0.open_session("t", Caller::root());
    let (g, _) = h0
        .alloc(s0, 4096, 1, None, None)
        .expect("alloc")
        .pop()
        .expect("one grant");
    h0.raw_pool_fd(g.pool, true)
        .expect("the pool")
        .write_all_at(&[7u8; 4096], g.offset)
        .expect("write");
    a0.hold_watch(true);
    put(&h1, "k", b"h1's").expect("h1 publishes");
    let deleted = h1
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    h0.publish(s0, g.alloc, "ns", "k", None)
        .expect("h0 publishes the name, free at etcd");
    h0.close_session(s0);
    a0.hold_watch(false);
    eventually("h0 serves again", || !a0.fenced());
    assert_eq!(get(&h0, "k").as_deref(), Some(&[7u8; 4096][..]));
    // A client of h1 maps h0's entry.
    eventually("h1 serves h0's ns/k", || {
        get(&h1, "k").is_some_and(|b| b == [7u8; 4096])
    });
    let reader = h1.open_session("reader", Caller::root());
    let mapped = h1
        .retrieve(reader, "ns", &["k".to_owned()], |_| false)
        .expect("retrieve");
    assert!(mapped[0].is_some(), "h1 maps ns/k");
    let used = |h: &Store| h.pools()[0].used;
    let before = used(&h0);
    let deleted = h0
        .delete(&Caller::root(), "ns", &["k".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    // h1 applies the removal and records its reader's hold meanwhile.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        used(&h0),
        before,
        "h0 freed its entry's extent while a client of h1 maps it"
    );
    h1.close_session(reader);
    eventually("freed once h1's reader let go", || used(&h0) < before);
}

/// Etcd granted `h0`'s first publication of `ns/k`; the applier files another host's entry
/// of the name, created before it (its removal not yet applied here), before the seal.
fn file_another_host_s_k_once_granted(h0: &Arc<Store>, uuid: &str) {
    let (me, pool, once) = (Arc::downgrade(h0), uuid.to_owned(), AtomicBool::new(false));
    h0.set_ask_gate(Some(Box::new(move |at, ns, key| {
        if (at, ns, key) != ("published", "ns", "k") || once.swap(true, Ordering::SeqCst) {
            return;
        }
        let h = me.upgrade().expect("the host");
        let filed = h.file_remote(&pool, "ns", "k", POOL - UNIT, 4096, 1);
        assert!(matches!(filed, Ok(true)), "{filed:?}");
    })));
}

/// A writer through `h0`'s mount of `ns/name`, written `data`, not closed: the mount's
/// view, its caller, the namespace's inode and the writer's.
fn mount_writer(
    h0: &Arc<Store>,
    name: &str,
    data: &[u8],
) -> (maru_daemon::store::fsview::StoreFs, Caller, u64, u64) {
    use maru_fsd::Backend;
    let fs = maru_daemon::store::fsview::StoreFs(h0.clone());
    let caller = Caller::new(0, 0, std::process::id() as i32);
    let ns = fs
        .lookup(&caller, maru_fsd::backend::ROOT_INO, "ns")
        .expect("ns")
        .ino;
    let (a, _) = fs.create(&caller, ns, name, 0o644).expect("create");
    fs.write(a.ino, 0, data).expect("write");
    (fs, caller, ns, a.ino)
}

/// [`mount_writer`], closed (committed, not yet published).
fn closed_mount_writer(
    h0: &Arc<Store>,
    name: &str,
    data: &[u8],
) -> (maru_daemon::store::fsview::StoreFs, Caller, u64, u64) {
    use maru_fsd::Backend;
    let (fs, caller, ns, ino) = mount_writer(h0, name, data);
    fs.commit(&caller, ino, false).expect("close");
    (fs, caller, ns, ino)
}

/// A mount writer's reservation that etcd made but whose answer was lost (its close failed)
/// is given back: the name is free again for every host. It stayed reserved for as long as
/// the host's lease lived, and no host could store the name.
#[test]
fn a_reservation_whose_answer_was_lost_is_given_back() {
    use maru_fsd::Backend;
    let Some((etcd, dir, uuid, h0, auth)) = one_host() else {
        return;
    };
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    auth.lose_reservation_answers(1);
    let (fs, caller, _, ino) = mount_writer(&h0, "k", b"lost");
    let closed = fs.commit(&caller, ino, false);
    assert!(closed.is_err(), "the close heard no answer: {closed:?}");
    eventually("the reservation is given back", || {
        !auth.unreserving("ns", "k")
    });
    assert!(!EtcdView::new(&etcd, &uuid).has_reservation("k"));
    put(&h1, "k", b"stored elsewhere").expect("h1 stores the name");
    eventually("h0 serves h1's entry", || {
        get(&h0, "k").as_deref() == Some(&b"stored elsewhere"[..])
    });
}

/// The writer's last release comes while its rename after the close is at etcd (the kernel
/// sends the release on its own, right after the close): the seal waits for the rename's
/// answer and publishes the entry under its new name. It went ahead under the old name in
/// between, and the rename's answer then gave that name back here while etcd kept its
/// record: the entry was dropped, its extent freed under the record.
#[test]
fn a_mount_writer_s_release_during_its_rename_publishes_it_under_the_new_name() {
    use maru_fsd::Backend;
    let Some((etcd, _dir, uuid, h0, _auth)) = one_host() else {
        return;
    };
    let (fs, caller, ns, ino) = closed_mount_writer(&h0, "k.tmp", b"released while renamed");
    type Release = std::thread::JoinHandle<maru::Result<()>>;
    let release: Arc<std::sync::Mutex<Option<Release>>> = Arc::default();
    let (me, seal, once) = (Arc::downgrade(&h0), release.clone(), AtomicBool::new(false));
    h0.set_ask_gate(Some(Box::new(move |at, _, key| {
        if (at, key) != ("reserved", "k") || once.swap(true, Ordering::SeqCst) {
            return;
        }
        let fs = maru_daemon::store::fsview::StoreFs(me.upgrade().expect("the host"));
        let t = std::thread::spawn(move || fs.seal(ino));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !t.is_finished(),
            "the release sealed while the rename was at etcd"
        );
        *seal.lock().expect("one") = Some(t);
    })));
    fs.rename(&caller, ns, "k.tmp", ns, "k").expect("rename");
    let t = release
        .lock()
        .expect("one")
        .take()
        .expect("the release ran");
    t.join().expect("the release").expect("published");
    h0.set_ask_gate(None);
    assert_eq!(
        get(&h0, "k").as_deref(),
        Some(&b"released while renamed"[..])
    );
    assert!(get(&h0, "k.tmp").is_none());
    let view = EtcdView::new(&etcd, &uuid);
    assert!(view.has_entry("k"));
    assert!(!view.has_entry("k.tmp"));
}

/// An earlier run of h0 that stored `ns/k` (5000 bytes of 1), then stopped as a killed host
/// does: cut off from etcd for good (it reached etcd through a relay of its own), its lease
/// ended. Its state directory and the pool stay for h0's next run; the run itself stays, idle,
/// with its relay, while the test lasts. Before `ns/k` it stored and deleted another entry,
/// so that `ns/k`'s record names an allocation the next run does not give it again. Returns
/// the run, its relay, and the offset of `ns/k`.
fn an_earlier_run_stored_k(etcd: &Etcd, dir: &Path, uuid: &str) -> (Arc<Store>, Relay, u64) {
    let relay = Relay::to(etcd);
    let (h0, _) = host_at(vec![relay.endpoint.clone()], dir, "h0", uuid);
    put(&h0, "gone", b"an entry deleted").expect("the earlier run stores ns/gone");
    let deleted = h0
        .delete(&Caller::root(), "ns", &["gone".to_owned()])
        .expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    put(&h0, "k", &[1u8; 5000]).expect("the earlier run stores ns/k");
    let at = offset_of(&h0, "k").expect("the earlier run serves ns/k");
    relay.set_cut(true);
    let view = EtcdView::new(etcd, uuid);
    view.revoke(view.lease("h0").expect("the earlier run's lease"));
    (h0, relay, at)
}

/// A restart claims again the regions of the entries it recovered; another host may hold one
/// a moment (it claimed the region afresh while this host was down, and gives it back once
/// it finds this host's entry there). The start waits it out: at the first refusal, marud
/// failed to start.
#[test]
fn a_restart_waits_out_another_host_s_moment_over_a_region_of_its_entries() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let (_earlier, _relay, at) = an_earlier_run_stored_k(&etcd, dir.path(), &uuid);
    let view = Arc::new(EtcdView::new(&etcd, &uuid));
    let region = at / UNIT * UNIT;
    view.set_claim(region, Some("h9"));
    let v = view.clone();
    let other = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        v.set_claim(region, None);
    });
    let (h0, auth) = host_and_authority(&etcd, dir.path(), "h0", &uuid);
    other.join().expect("the other host");
    eventually("h0 serves its ns/k", || {
        get(&h0, "k").is_some_and(|b| b == [1u8; 5000])
    });
    assert!(
        h0.remote_entries().is_empty(),
        "h0's ns/k counts as another host's"
    );
    view.claims_match(&auth, &uuid);
}

/// A restart cut off from etcd a moment while it recovers its entries asks again. Given up
/// on, an entry it published kept its record in etcd with no entry here, and the host's first
/// read of every entry filed it as another host's: served, never evicted, its extent no
/// host's to free.
#[test]
fn a_restart_cut_off_from_etcd_a_moment_recovers_its_entries_as_its_own() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let _earlier = an_earlier_run_stored_k(&etcd, dir.path(), &uuid);
    // The next run joins, and is cut off for two seconds as its recovery begins.
    let relay = Relay::to(&etcd);
    let settings = ClusterSettings {
        endpoints: vec![relay.endpoint.clone()],
        node: "h0".to_owned(),
        ttl: Duration::from_secs(10),
        orphans_after: Duration::from_secs(300),
    };
    let auth = EtcdAuthority::join(&settings, &uuid).expect("joining the cluster");
    relay.set_cut(true);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        relay.set_cut(false);
        relay
    });
    let cfg = StoreConfig {
        eviction: Eviction::Off,
        state_dir: dir.path().join("state-h0"),
        wal_sync: false,
        max_copy_entry: 1 << 30,
    };
    let spec = PoolSpec::parse(&format!(
        "file:{}/cxl.img,size={POOL}",
        dir.path().display()
    ))
    .expect("pool spec");
    let h0 = Store::open_with(cfg, &[spec], auth.clone()).expect("opening the store");
    let _relay = opener.join().expect("the relay");
    start_applier(h0.clone(), auth).expect("the applier");
    eventually("h0 serves its ns/k", || {
        get(&h0, "k").is_some_and(|b| b == [1u8; 5000])
    });
    assert!(
        h0.remote_entries().is_empty(),
        "h0's ns/k counts as another host's"
    );
}

/// A publication etcd granted that this host then cannot seal (here a namespace of its name,
/// made meanwhile) is given back as a delete removes an entry: its record removed from etcd
/// with the store's lock let go of, and its extent freed only once no host maps it (a client
/// of h1 mapped the entry between the grant and the seal). It was given back under the lock
/// (in a debug build an assertion; in a release build a round trip under the lock), and its
/// extent freed at once, under h1's reader.
#[test]
fn a_granted_publication_that_cannot_be_sealed_is_removed_as_a_delete_is() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let uuid = pool_file(dir.path());
    let h0 = host(&etcd, dir.path(), "h0", &uuid);
    let h1 = host(&etcd, dir.path(), "h1", &uuid);
    let used = |h: &Store| h.pools()[0].used;
    let reader = h1.open_session("reader", Caller::root());
    let before = Arc::new(AtomicU64::new(0));
    let (me, there, seen) = (Arc::downgrade(&h0), h1.clone(), before.clone());
    let once = AtomicBool::new(false);
    h0.set_ask_gate(Some(Box::new(move |at, ns, key| {
        if (at, ns, key) != ("published", "ns", "k") || once.swap(true, Ordering::SeqCst) {
            return;
        }
        // A client of h1 maps the entry, which h1 learned of from etcd.
        eventually("h1 serves ns/k", || get(&there, "k").is_some());
        let mapped = there
            .retrieve(reader, "ns", &["k".to_owned()], |_| false)
            .expect("retrieve");
        assert!(mapped[0].is_some(), "h1 maps ns/k");
        // On h0 the name becomes a namespace meanwhile: the entry cannot be sealed there.
        let h0 = me.upgrade().expect("the host");
        h0.mkdir(&Caller::root(), "ns/k", 0o755)
            .expect("mkdir ns/k");
        seen.store(h0.pools()[0].used, Ordering::SeqCst);
    })));
    let stored = put(&h0, "k", &[7u8; 5000]);
    h0.set_ask_gate(None);
    assert!(matches!(stored, Err(maru::Error::Exists(_))), "{stored:?}");
    let view = EtcdView::new(&etcd, &uuid);
    assert!(
        !view.has_entry("k"),
        "etcd kept the record of a publication given back"
    );
    eventually("h1 drops ns/k", || get(&h1, "k").is_none());
    let before = before.load(Ordering::SeqCst);
    assert!(before > 0, "the seam ran");
    // h1 applies the removal and records its reader's hold meanwhile.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        used(&h0),
        before,
        "h0 freed the extent of a publication it gave back while a client of h1 maps it"
    );
    h1.close_session(reader);
    eventually("freed once h1's reader let go", || used(&h0) < before);
    // The name is free again, here and at etcd, once the namespace of its name goes.
    h0.rmdir(&Caller::root(), "ns/k").expect("rmdir ns/k");
    put(&h0, "k", b"again").expect("the name is free again");
    eventually("h1 serves the new ns/k", || {
        get(&h1, "k").is_some_and(|b| b == b"again")
    });
    h0.check_invariants().expect("h0's invariants");
}

/// A namespace's quota holds for a batch in the shared pool: the publication that does not
/// fit is refused at its placement, before etcd is asked. It was checked again only at the
/// seal, after etcd's grant, and its publication then given back under the store's lock (in
/// a debug build an assertion; in a release build a round trip under the lock, and its
/// extent freed at once while other hosts may serve it).
#[test]
fn a_batch_over_its_quota_in_the_shared_pool_is_refused_before_etcd_grants_it() {
    let Some((etcd, _dir, uuid, h0, _auth)) = one_host() else {
        return;
    };
    h0.set_quota(&Caller::root(), "ns", Some(8192))
        .expect("quota");
    let s = h0.open_session("t", Caller::root());
    let grants = h0.alloc(s, 5000, 2, None, None).expect("alloc");
    let items: Vec<Publish<'_>> = grants
        .iter()
        .zip(["a", "b"])
        .map(|((g, _), key)| Publish {
            id: g.alloc,
            ns: "ns",
            key,
            len: None,
        })
        .collect();
    let out = h0.publish_many(s, &items);
    h0.close_session(s);
    assert!(out[0].is_ok(), "{out:?}");
    assert!(matches!(out[1], Err(maru::Error::Quota(_))), "{out:?}");
    let view = EtcdView::new(&etcd, &uuid);
    assert!(view.has_entry("a"));
    assert!(
        !view.has_entry("b"),
        "etcd was asked for a publication over the quota"
    );
    h0.check_invariants().expect("h0's invariants");
}
