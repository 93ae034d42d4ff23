//! `--stores-only`: the rate of small stores in cluster mode (issue 35's targets). One host,
//! a marud in cluster mode on a `file:` pool in /dev/shm with etcd on loopback, its clients
//! storing 4 KiB entries: one client in a loop, `batch_store` of 64, eight clients at once;
//! then the same entries deleted the same three ways; one client and eight of the same marud without `--cluster`,
//! for reference. With `--before MARUD`, another build's marud runs the same rounds,
//! alternated with this one's, and the rows are printed side by side. With `--wal-sync`,
//! every marud syncs its pool's log at each record.

use std::path::Path;
use std::time::{Duration, Instant};

use maru_tools::bench::{Row, fmt_table, rate, scratch};
use maru_tools::env::{PrivateDaemon, sibling};

use super::{PoolDir, pool_file};

/// Entries of one `batch_store`.
const BATCH: usize = 64;
/// Clients storing at once.
const CLIENTS: usize = 8;
/// The size of each entry.
const SMALL: usize = 4096;

/// One build's rates: stores by one client, a batch's entries, eight clients, one client
/// alone; deletes by one client, a batch, eight clients.
#[derive(Default, Clone, Copy)]
struct Rates {
    one: f64,
    batch: f64,
    eight: f64,
    single_host: f64,
    single_host_eight: f64,
    del_one: f64,
    del_batch: f64,
    del_eight: f64,
}

pub(super) fn stores(
    rounds: usize,
    runs: usize,
    before: Option<&Path>,
    wal_sync: bool,
) -> anyhow::Result<String> {
    anyhow::ensure!(rounds >= 8 && runs >= 1, "--rounds >= 8 and --runs >= 1");
    let etcd = maru_cluster::testing::Etcd::start()
        .ok_or_else(|| anyhow::anyhow!("cluster mode needs etcd: apt-get install etcd-server"))?;
    let now = sibling("marud")?;
    let mut builds: Vec<(&str, &Path)> = Vec::new();
    if let Some(b) = before {
        builds.push(("before", b));
    }
    builds.push(("now", &now));
    let mut all: Vec<Vec<Rates>> = vec![Vec::new(); builds.len()];
    for run in 0..runs {
        // Alternated: each build goes first in every other run.
        let mut order: Vec<usize> = (0..builds.len()).collect();
        if run % 2 == 1 {
            order.reverse();
        }
        for b in order {
            let node = format!("s{run}{}", builds[b].0);
            all[b].push(measure(builds[b].1, &etcd, &node, rounds, wal_sync)?);
        }
    }
    let mut rows: Vec<Row> = Vec::new();
    for ((name, _), rates) in builds.iter().zip(&all) {
        for (i, r) in rates.iter().enumerate() {
            let at = |case: &str, per_sec: f64| {
                let n = 1_000_000u64;
                rate(
                    &format!("[{name}, run {}] {case}", i + 1),
                    n,
                    Duration::from_secs_f64(n as f64 / per_sec),
                )
            };
            rows.push(at("cluster: one client, 4 KiB stores", r.one));
            rows.push(at(
                &format!("cluster: batch_store of {BATCH} x 4 KiB (entries)"),
                r.batch,
            ));
            rows.push(at(
                &format!("cluster: {CLIENTS} clients at once, 4 KiB stores (all)"),
                r.eight,
            ));
            rows.push(at("single host: one client, 4 KiB stores", r.single_host));
            rows.push(at(
                &format!("single host: {CLIENTS} clients at once, 4 KiB stores (all)"),
                r.single_host_eight,
            ));
            rows.push(at("cluster: one client, deletes", r.del_one));
            rows.push(at(
                &format!("cluster: batch_delete of {BATCH} (entries)"),
                r.del_batch,
            ));
            rows.push(at(
                &format!("cluster: {CLIENTS} clients at once, deletes (all)"),
                r.del_eight,
            ));
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out = String::from("# maru-cluster-bench --stores-only\n");
    out.push_str(&format!(
        "\nOne marud in cluster mode on a `file:` pool in /dev/shm, etcd on loopback; \
         {rounds} rounds; {runs} run(s); this machine ({cpus} CPUs).{}\n",
        if wal_sync {
            " Every marud with `--wal-sync` (its log on disk, synced at each record)."
        } else {
            ""
        }
    ));
    out.push_str(&fmt_table("Measured", &rows));
    let median = |f: fn(&Rates) -> f64, b: usize| {
        let mut v: Vec<f64> = all[b].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let b = builds.len() - 1;
    let (one, batch, eight) = (
        median(|r| r.one, b),
        median(|r| r.batch, b),
        median(|r| r.eight, b),
    );
    let check = |ok: bool| if ok { "met" } else { "NOT met" };
    out.push_str(&format!(
        "\n## Targets (issue 35; medians of this build's runs)\n\n| target | measured | |\n\
         |---|---:|---|\n\
         | batch_store of 64 x 4 KiB >= 20,000 entries/s | {batch:.0}/s | {} |\n\
         | {CLIENTS} clients >= 5x one client | {:.1}x | {} |\n\
         | {CLIENTS} clients >= 10,000/s in total | {eight:.0}/s | {} |\n",
        check(batch >= 20_000.0),
        eight / one,
        check(eight >= 5.0 * one),
        check(eight >= 10_000.0),
    ));
    if before.is_some() {
        let was = median(|r| r.one, 0);
        out.push_str(&format!(
            "| one client no slower than before | {one:.0}/s against {was:.0}/s ({:.2}x) | {} |\n",
            one / was,
            check(one >= was * 0.9),
        ));
    }
    Ok(out)
}

/// One build's rounds: a host in cluster mode (node `node`), then the same marud alone.
fn measure(
    marud: &Path,
    etcd: &maru_cluster::testing::Etcd,
    node: &str,
    rounds: usize,
    wal_sync: bool,
) -> anyhow::Result<Rates> {
    let sync: &[&str] = if wal_sync { &["--wal-sync"] } else { &[] };
    let tmp = scratch()?;
    let size: u64 = 1 << 30;
    let shm = PoolDir::new(false, size)?;
    let spec = pool_file(&shm.dir.path().join("cxl.img"), size)?;
    let eps = etcd.endpoints().join(",");
    let d = PrivateDaemon::start_exe(
        marud,
        tmp.path(),
        node,
        &[spec.as_str()],
        false,
        &[
            &["--cluster", &eps, "--node", node, "--eviction", "off"],
            sync,
        ]
        .concat(),
    )?;
    let mut r = Rates::default();
    let h = d.handler("kv")?;
    h.mkdir("kv", 0o777)?;
    r.one = one_client(&h, "one", rounds * 5)?;
    r.batch = batches(&h, rounds / 4)?;
    r.eight = clients(&d, rounds * 2, one_client)?;
    r.del_one = deletes(&h, "one", rounds * 5)?;
    r.del_batch = batch_deletes(&h, rounds / 4)?;
    r.del_eight = clients(&d, rounds * 2, deletes)?;
    drop(h);
    drop(d);
    // The same marud, alone (no etcd), on a pool of its own.
    let spec = pool_file(&tmp.path().join("alone.img"), size)?;
    let d = PrivateDaemon::start_exe(
        marud,
        tmp.path(),
        "alone",
        &[spec.as_str()],
        false,
        &[&["--eviction", "off"], sync].concat(),
    )?;
    let h = d.handler("kv")?;
    h.mkdir("kv", 0o777)?;
    r.single_host = one_client(&h, "one", rounds * 5)?;
    r.single_host_eight = clients(&d, rounds * 2, one_client)?;
    Ok(r)
}

/// `n` stores of 4 KiB under `prefix`, one after the other: per second.
fn one_client(h: &maru::Handler, prefix: &str, n: usize) -> anyhow::Result<f64> {
    let small = vec![0x5au8; SMALL];
    let t = Instant::now();
    for i in 0..n {
        let mut a = h.alloc(SMALL as u64)?;
        a.as_mut_slice().copy_from_slice(&small);
        h.store(&format!("kv/{prefix}-{i}"), a)?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// `n` batch stores of [`BATCH`] entries: entries per second.
fn batches(h: &maru::Handler, n: usize) -> anyhow::Result<f64> {
    let small = vec![0x5au8; SMALL];
    let t = Instant::now();
    for b in 0..n {
        let mut items = Vec::with_capacity(BATCH);
        for i in 0..BATCH {
            let mut a = h.alloc(SMALL as u64)?;
            a.as_mut_slice().copy_from_slice(&small);
            items.push((format!("kv/batch-{b}-{i}"), a));
        }
        for r in h.batch_store(items)? {
            r?;
        }
    }
    Ok((n * BATCH) as f64 / t.elapsed().as_secs_f64())
}

/// `n` deletes of the entries [`one_client`] stored under `prefix`, one after the other: per
/// second.
fn deletes(h: &maru::Handler, prefix: &str, n: usize) -> anyhow::Result<f64> {
    let t = Instant::now();
    for i in 0..n {
        h.delete(&format!("kv/{prefix}-{i}"))?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// `n` batch deletes of the entries [`batches`] stored: entries per second.
fn batch_deletes(h: &maru::Handler, n: usize) -> anyhow::Result<f64> {
    let t = Instant::now();
    for b in 0..n {
        let names: Vec<String> = (0..BATCH).map(|i| format!("kv/batch-{b}-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        for r in h.batch_delete(&refs)? {
            r?;
        }
    }
    Ok((n * BATCH) as f64 / t.elapsed().as_secs_f64())
}

/// [`CLIENTS`] clients of `d` at once, each doing `work` over `n` entries of its own (`c0`,
/// `c1`, ...): all of them per second.
fn clients(
    d: &PrivateDaemon,
    n: usize,
    work: fn(&maru::Handler, &str, usize) -> anyhow::Result<f64>,
) -> anyhow::Result<f64> {
    let hs = (0..CLIENTS)
        .map(|_| d.handler("kv"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let start = std::sync::Barrier::new(CLIENTS + 1);
    let t = std::thread::scope(|s| -> anyhow::Result<Duration> {
        let workers: Vec<_> = hs
            .iter()
            .enumerate()
            .map(|(c, h)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    work(h, &format!("c{c}"), n)
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        for w in workers {
            w.join().expect("client")?;
        }
        Ok(t.elapsed())
    })?;
    Ok((CLIENTS * n) as f64 / t.as_secs_f64())
}
