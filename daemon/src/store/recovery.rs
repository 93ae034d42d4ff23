//! Opening the pools and recovering what they hold: namespaces from the state directory,
//! sealed entries from each pool (a memfs pool's tree, a raw pool's log).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use maru::name::{check_component, split_ns};
use maru::proto::PoolKind;

use super::authority::{Authority, Placed};
use super::entries::Entry;
use super::hashmap::HashMap;
use super::ids::{PoolIdx, SessionId};
use super::lru::Lru;
use super::namespaces::Namespaces;
use super::policy::Perm;
use super::pools::memfs::Memfs;
use super::pools::raw::Raw;
use super::pools::{Loc, Pool};
use super::settings::StoreConfig;
use super::state::{PoolSlot, Session, State};
use crate::pool::PoolSpec;
use maru_fsd::Caller;
use maru_fsd::backend::ROOT_INO;

/// Opens every pool of `specs` and recovers the namespaces and entries.
pub fn open_state(
    cfg: &StoreConfig,
    specs: &[PoolSpec],
    authority: &Arc<dyn Authority>,
) -> anyhow::Result<State> {
    use anyhow::Context;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating state dir {}", cfg.state_dir.display()))?;
    let mut names = HashSet::new();
    let mut pools = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        if !names.insert(spec.name.clone()) {
            anyhow::bail!("two pools are named `{}`", spec.name);
        }
        let pool: Box<dyn Pool> = match spec.kind {
            PoolKind::Memfs => Box::new(Memfs::open(spec, &cfg.state_dir, cfg.wal_sync)?),
            PoolKind::Devdax | PoolKind::File => Box::new(Raw::open(
                spec,
                &cfg.state_dir,
                cfg.wal_sync,
                authority.clone(),
            )?),
        };
        pools.push(PoolSlot {
            id: PoolIdx::at(i),
            name: spec.name.clone(),
            kind: spec.kind,
            path: spec.path.clone(),
            pool,
            sealed_bytes: 0,
            entries: 0,
            writing_bytes: 0,
            evictions: 0,
        });
    }
    let mut st = State {
        next_ino: ROOT_INO + 1,
        ns: Namespaces::new(cfg.state_dir.join("namespaces.json"))?,
        entries: HashMap::default(),
        zombies: HashMap::default(),
        allocs: HashMap::default(),
        lru: Lru::default(),
        sessions: HashMap::from_iter([(
            SessionId::MOUNT,
            Session {
                name: "mount".into(),
                caller: Some(Caller::root()),
                ..Default::default()
            },
        )]),
        next_session: SessionId::MOUNT.next(),
        pools,
        gone: HashMap::default(),
        fuse_leases: HashMap::default(),
        pinning: Default::default(),
    };
    let mut next = st.next_ino;
    st.ns.load(|| {
        next += 1;
        next - 1
    })?;
    st.next_ino = next;
    for p in 0..st.pools.len() {
        recover_pool(&mut st, p, &**authority)?;
    }
    // Namespace directories take their namespaces' access as the state directory has it (the
    // tree may come from a run that stopped before it applied a change): each one once.
    let names: Vec<String> = st.ns.iter().map(|(n, _)| n.clone()).collect();
    for n in names {
        st.mirror_ns_access(&n);
    }
    st.ns.save();
    tracing::info!(
        entries = st.entries.len(),
        namespaces = st.ns.len(),
        "store recovered"
    );
    Ok(st)
}

fn ensure_path(st: &mut State, ns: &str) -> maru::Result<()> {
    let mut next = st.next_ino;
    let r = st.ns.ensure_path(ns, || {
        next += 1;
        next - 1
    });
    st.next_ino = next;
    r
}

/// Recovers pool `p`'s entries; a name taken already (by an earlier pool) is skipped.
fn recover_pool(st: &mut State, p: usize, authority: &dyn Authority) -> anyhow::Result<()> {
    let (dirs, found) = st.pools[p].pool.recover()?;
    for d in dirs {
        if split_ns(&d).is_ok() {
            ensure_path(st, &d)?;
        }
    }
    let mut kept = Vec::new();
    for f in found {
        if split_ns(&f.ns).is_err() || check_component(f.key.as_bytes()).is_err() {
            continue;
        }
        ensure_path(st, &f.ns)?;
        let ino = st.alloc_ino();
        let at = Placed {
            pool: st.pools[p].pool.uuid(),
            place: f.place,
            size: f.size,
        };
        match publish_recovered(authority, &f.ns, &f.key, ino, &at) {
            Ok(()) => {}
            // Not known to be this host's, nor another's: neither kept nor skipped (its record
            // would count as another host's ever after, an entry no host evicts or frees).
            Err(e @ maru::Error::Io(_)) => {
                anyhow::bail!(
                    "recovering {}/{}: the authority did not answer: {e}",
                    f.ns,
                    f.key
                )
            }
            Err(e) => {
                // The name is another's, or (cluster mode) this host's record of it is gone: it
                // was removed while this host was down, and its extent is not this host's now.
                tracing::warn!(ns = %f.ns, key = %f.key, "not recovered: {e}");
                continue;
            }
        }
        let perm = Perm {
            uid: f.uid,
            gid: f.gid,
            mode: f.mode,
        };
        let e = Entry::new(ino, &f.ns, &f.key, PoolIdx::at(p), f.place, f.size, perm)
            .recovered(f.pinned, f.mtime);
        kept.push(ino);
        st.insert_entry(e);
        authority.settled(&f.ns, &f.key);
    }
    // The pool settles its own accounting (a raw pool's regions) from what was kept.
    let locs: Vec<Loc<'_>> = kept.iter().map(|i| st.entries[i].loc()).collect();
    st.pools[p].pool.recovered(&locs)?;
    Ok(())
}

/// How long a start asks the authority again to publish an entry it recovered while the
/// authority does not answer (etcd electing a leader, a connection lost a moment).
const RECOVER_PATIENCE: Duration = Duration::from_secs(30);

/// Publishes recovered entry `ns/key` (`ino`, placed at `at`) at the authority, asking again
/// every quarter second while the authority does not answer (an I/O error: etcd unreachable,
/// or its answer lost), for up to [`RECOVER_PATIENCE`]; the last outcome. Given up on at the
/// first such error, an entry this host published kept its record in etcd with no entry
/// here, and the first read of every entry filed it as another host's.
fn publish_recovered(
    authority: &dyn Authority,
    ns: &str,
    key: &str,
    ino: u64,
    at: &Placed<'_>,
) -> maru::Result<()> {
    let deadline = Instant::now() + RECOVER_PATIENCE;
    loop {
        match authority.publish(ns, key, ino, at) {
            Err(maru::Error::Io(e)) if Instant::now() < deadline => {
                tracing::warn!(ns, key, "recovering an entry: {e}; asking again");
                std::thread::sleep(Duration::from_millis(250));
            }
            r => return r,
        }
    }
}
