//! The four cases: context length, fan-out, churn and metadata.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::data::{self, CHUNK_BYTES, CHUNK_TOKENS};
use crate::servers::{Redis, TcpProducer, process_cpu_ns};
use crate::stats::{Stat, quantile};
use crate::systems::{Consumer, Outcome, Spec, System};
use maru_tools::env::PrivateDaemon;

/// The running systems every case uses.
pub struct Env {
    /// The maru daemon (memfs pool, mount).
    pub daemon: PrivateDaemon,
    /// Its mount.
    pub mount: PathBuf,
    /// Its memfs pool directory.
    pub pool: PathBuf,
    /// Redis without a memory limit.
    pub redis: Redis,
    /// Scratch directory.
    pub dir: PathBuf,
}

impl Env {
    fn spec(&self, system: System, ns: &str, chunks: usize, tcp_port: u16, read: bool) -> Spec {
        Spec {
            system,
            chunks,
            chunk_bytes: CHUNK_BYTES,
            ns: ns.into(),
            mount: self.mount.clone(),
            pool: self.pool.clone(),
            socket: self.daemon.socket.clone(),
            tcp_port,
            redis_port: self.redis.port,
            read_pass: read,
        }
    }
}

/// KV of one context stored in maru (through the mount) and in Redis, and held by a TCP
/// producer; dropped from all three on drop.
struct Stored<'a> {
    env: &'a Env,
    ns: String,
    chunks: usize,
    tcp: TcpProducer,
    /// Checksum every consumer must read.
    sum: u64,
    /// Seconds the producer took to store into maru through the mount, and into Redis.
    store_maru_s: f64,
    store_redis_s: f64,
}

impl<'a> Stored<'a> {
    fn new(env: &'a Env, ns: &str, chunks: usize) -> anyhow::Result<Self> {
        let dir = env.mount.join(ns);
        std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let mut con = env.redis.connect()?;
        let mut buf = vec![0u8; CHUNK_BYTES];
        let (mut t_maru, mut t_redis, mut sum) = (0.0, 0.0, 0u64);
        for i in 0..chunks {
            data::fill(i as u64, &mut buf);
            sum = sum.wrapping_add(data::sum(&buf));
            let t = Instant::now();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(dir.join(format!("c{i}")))?;
            f.write_all(&buf)?;
            drop(f); // published at close
            t_maru += t.elapsed().as_secs_f64();
            let t = Instant::now();
            redis::cmd("SET")
                .arg(format!("{ns}:c{i}"))
                .arg(&buf[..])
                .query::<()>(&mut con)?;
            t_redis += t.elapsed().as_secs_f64();
        }
        let tcp = TcpProducer::start(chunks, CHUNK_BYTES)?;
        Ok(Stored {
            env,
            ns: ns.into(),
            chunks,
            tcp,
            sum,
            store_maru_s: t_maru,
            store_redis_s: t_redis,
        })
    }

    /// Touches every page of the stored KV in the pool (as the pool's resident memory would be
    /// in steady use). On these VMs, after another consumer allocated and freed gigabytes, the
    /// first process to touch the pool's pages pays for that churn (measured here: 140-350 ms
    /// for 2 GiB, whichever system comes first); settling between consumers keeps that cost out
    /// of the next consumer's time, whatever the order.
    fn settle(&self) -> anyhow::Result<()> {
        let dir = self.env.pool.join("n").join(&self.ns);
        for i in 0..self.chunks {
            maru_tools::bench::map_touch(&dir.join(format!("c{i}")))?;
        }
        Ok(())
    }

    fn server_pid(&self, s: System) -> Option<u32> {
        match s {
            System::MaruFs | System::Libmaru => self.env.daemon.pid(),
            System::Tcp => Some(self.tcp.pid()),
            System::Redis => Some(self.env.redis.pid()),
            System::Direct | System::Copy => None,
        }
    }
}

impl Drop for Stored<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.env.mount.join(&self.ns));
        if let Ok(mut con) = self.env.redis.connect() {
            for i in 0..self.chunks {
                let _ = redis::cmd("DEL")
                    .arg(format!("{}:c{i}", self.ns))
                    .query::<i64>(&mut con);
            }
        }
    }
}

/// The order of the systems in round `round`: a permutation drawn from a fixed seed, so that
/// noise and machine state hit every system alike and no system always runs right after the
/// same other one. (This matters here: a consumer that follows one that allocated and freed
/// gigabytes pays for the memory churn on its first touches.)
fn rotated(round: usize) -> Vec<System> {
    use rand::seq::SliceRandom;
    let mut v = System::ALL.to_vec();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6f72_6465_7200 + round as u64);
    v.shuffle(&mut rng);
    v
}

/// One system at one context length.
#[derive(Debug, Clone, Serialize)]
pub struct ContextRow {
    /// Tokens of context.
    pub tokens: usize,
    /// Bytes of KV.
    pub bytes: usize,
    /// The system.
    pub system: System,
    /// Milliseconds until every chunk is addressable in the consumer (every page touched).
    pub addressable_ms: Stat,
    /// Milliseconds until every byte has been read once.
    pub read_once_ms: Stat,
    /// Consumer CPU milliseconds until read once.
    pub consumer_cpu_ms: Stat,
    /// Milliseconds the producer took to store the KV (maru through the mount, Redis SET).
    pub store_ms: Option<f64>,
}

/// Context length: KV of `tokens` stored in 256-token chunks by one process, retrieved by
/// another, `reps` times per system, systems interleaved.
pub fn context(env: &Env, token_counts: &[usize], reps: usize) -> anyhow::Result<Vec<ContextRow>> {
    let mut rows = Vec::new();
    for &tokens in token_counts {
        let chunks = tokens.div_ceil(CHUNK_TOKENS);
        let ns = format!("ctx{tokens}");
        eprintln!(
            "context {} tokens: storing {}",
            data::tokens_label(tokens),
            data::size_label(chunks * CHUNK_BYTES)
        );
        let st = Stored::new(env, &ns, chunks)?;
        let mut samples: Vec<[Vec<f64>; 3]> = vec![Default::default(); System::ALL.len()];
        for round in 0..reps {
            for sys in rotated(round) {
                let spec = env.spec(sys, &ns, chunks, st.tcp.port, true);
                let mut c = Consumer::start(&spec)?;
                c.go()?;
                let o = c.finish()?;
                st.settle()?;
                anyhow::ensure!(
                    o.sum == st.sum,
                    "{} read wrong bytes at {tokens} tokens",
                    sys.key()
                );
                let k = System::ALL.iter().position(|s| *s == sys).unwrap_or(0);
                samples[k][0].push((o.addr_ns - o.go_ns) as f64 / 1e6);
                samples[k][1].push((o.read_ns - o.go_ns) as f64 / 1e6);
                samples[k][2].push(o.cpu_read_us as f64 / 1e3);
            }
            eprintln!("  round {}/{reps} done", round + 1);
        }
        for (k, [a, r, c]) in samples.into_iter().enumerate() {
            let system = System::ALL[k];
            rows.push(ContextRow {
                tokens,
                bytes: chunks * CHUNK_BYTES,
                system,
                addressable_ms: Stat::of(a),
                read_once_ms: Stat::of(r),
                consumer_cpu_ms: Stat::of(c),
                store_ms: match system {
                    System::MaruFs => Some(st.store_maru_s * 1e3),
                    System::Redis => Some(st.store_redis_s * 1e3),
                    _ => None,
                },
            });
        }
    }
    Ok(rows)
}

/// One system with some number of simultaneous consumers.
#[derive(Debug, Clone, Serialize)]
pub struct FanoutRow {
    /// Consumer processes.
    pub consumers: usize,
    /// The system.
    pub system: System,
    /// Milliseconds from the go signal until the last consumer holds the KV.
    pub wall_ms: Stat,
    /// CPU milliseconds of all consumers together.
    pub consumer_cpu_ms: Stat,
    /// CPU milliseconds of the serving process (marud, the TCP producer, redis-server).
    pub server_cpu_ms: Stat,
}

/// Fan-out: `n` consumers retrieve the same KV of `tokens` at the same time.
pub fn fanout(
    env: &Env,
    tokens: usize,
    consumer_counts: &[usize],
    reps: usize,
) -> anyhow::Result<Vec<FanoutRow>> {
    let chunks = tokens.div_ceil(CHUNK_TOKENS);
    let ns = "fanout";
    eprintln!(
        "fan-out: storing {} tokens ({})",
        data::tokens_label(tokens),
        data::size_label(chunks * CHUNK_BYTES)
    );
    let st = Stored::new(env, ns, chunks)?;
    let mut rows = Vec::new();
    for &n in consumer_counts {
        let mut samples: Vec<[Vec<f64>; 3]> = vec![Default::default(); System::ALL.len()];
        for round in 0..reps {
            for sys in rotated(round) {
                let spec = env.spec(sys, ns, chunks, st.tcp.port, false);
                let mut cs = (0..n)
                    .map(|_| Consumer::start(&spec))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let server = st.server_pid(sys);
                let cpu0 = server.map(process_cpu_ns).unwrap_or(0);
                let t0 = crate::systems::now_ns();
                for c in &mut cs {
                    c.go()?;
                }
                let outs: Vec<Outcome> = cs
                    .iter_mut()
                    .map(Consumer::outcome)
                    .collect::<anyhow::Result<_>>()?;
                let cpu1 = server.map(process_cpu_ns).unwrap_or(0);
                for c in cs {
                    c.end()?;
                }
                st.settle()?;
                let end = outs.iter().map(|o| o.addr_ns).max().unwrap_or(t0);
                let k = System::ALL.iter().position(|s| *s == sys).unwrap_or(0);
                samples[k][0].push((end - t0) as f64 / 1e6);
                samples[k][1].push(outs.iter().map(|o| o.cpu_addr_us).sum::<u64>() as f64 / 1e3);
                samples[k][2].push(cpu1.saturating_sub(cpu0) as f64 / 1e6);
            }
        }
        eprintln!("  {n} consumers done");
        for (k, [w, c, s]) in samples.into_iter().enumerate() {
            rows.push(FanoutRow {
                consumers: n,
                system: System::ALL[k],
                wall_ms: Stat::of(w),
                consumer_cpu_ms: Stat::of(c),
                server_cpu_ms: Stat::of(s),
            });
        }
    }
    Ok(rows)
}

/// One kind of operation in a mixed load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Store,
    Retrieve,
    Exists,
    Delete,
}

const OPS: [(Op, &str); 4] = [
    (Op::Store, "store"),
    (Op::Retrieve, "retrieve"),
    (Op::Exists, "exists"),
    (Op::Delete, "delete"),
];

/// One system under the mixed load.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnRow {
    /// The system (`maru-fs`, `libmaru` or `redis`).
    pub system: String,
    /// Operations per second over the whole run.
    pub ops_per_s: f64,
    /// Per operation kind: (name, count, p50 µs, p99 µs).
    pub per_op: Vec<(String, usize, f64, f64)>,
    /// Retrieves that found their key.
    pub retrieve_hits: usize,
    /// Entries evicted during the run (maru: the daemon's counter; Redis: evicted_keys).
    pub evicted: u64,
}

/// The operation sequence every system runs: stores of new keys, and retrieves, exists and
/// deletes of recent keys (some already evicted).
fn churn_ops(n: usize, prefill: usize, window: usize) -> Vec<(Op, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6d61_7275);
    let mut next = prefill;
    (0..n)
        .map(|_| {
            let r: u32 = rng.gen_range(0..100);
            let op = match r {
                0..25 => Op::Store,
                25..65 => Op::Retrieve,
                65..90 => Op::Exists,
                _ => Op::Delete,
            };
            if op == Op::Store {
                next += 1;
                (op, next - 1)
            } else {
                (op, rng.gen_range(next.saturating_sub(window)..next))
            }
        })
        .collect()
}

trait ChurnTarget {
    fn store(&mut self, id: usize, v: &[u8]) -> anyhow::Result<()>;
    fn retrieve(&mut self, id: usize) -> anyhow::Result<bool>;
    fn exists(&mut self, id: usize) -> anyhow::Result<bool>;
    fn delete(&mut self, id: usize) -> anyhow::Result<()>;
    fn evicted(&mut self) -> anyhow::Result<u64>;
}

struct LibTarget(maru::Handler);
struct FsTarget(PathBuf, maru::Handler);
struct RedisTarget(redis::Connection);

fn evictions(h: &maru::Handler) -> anyhow::Result<u64> {
    Ok(h.stats()?.pools.iter().map(|p| p.evictions).sum())
}

impl ChurnTarget for LibTarget {
    fn store(&mut self, id: usize, v: &[u8]) -> anyhow::Result<()> {
        let mut a = self.0.alloc(v.len() as u64)?;
        a.as_mut_slice().copy_from_slice(v);
        Ok(self.0.store(&format!("churn/k{id}"), a)?)
    }
    fn retrieve(&mut self, id: usize) -> anyhow::Result<bool> {
        Ok(match self.0.retrieve(&format!("churn/k{id}"))? {
            Some(m) => {
                std::hint::black_box(maru_tools::bench::touch(&m));
                true
            }
            None => false,
        })
    }
    fn exists(&mut self, id: usize) -> anyhow::Result<bool> {
        Ok(self.0.exists(&format!("churn/k{id}"))?)
    }
    fn delete(&mut self, id: usize) -> anyhow::Result<()> {
        match self.0.delete(&format!("churn/k{id}")) {
            Ok(()) | Err(maru::Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
    fn evicted(&mut self) -> anyhow::Result<u64> {
        evictions(&self.0)
    }
}

impl ChurnTarget for FsTarget {
    fn store(&mut self, id: usize, v: &[u8]) -> anyhow::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(self.0.join(format!("k{id}")))?;
        f.write_all(v)?;
        Ok(())
    }
    fn retrieve(&mut self, id: usize) -> anyhow::Result<bool> {
        match std::fs::File::open(self.0.join(format!("k{id}"))) {
            Ok(f) => {
                // SAFETY: read-only mapping of an immutable entry.
                let m = unsafe { memmap2::Mmap::map(&f)? };
                std::hint::black_box(maru_tools::bench::touch(&m));
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
    fn exists(&mut self, id: usize) -> anyhow::Result<bool> {
        Ok(std::fs::symlink_metadata(self.0.join(format!("k{id}"))).is_ok())
    }
    fn delete(&mut self, id: usize) -> anyhow::Result<()> {
        match std::fs::remove_file(self.0.join(format!("k{id}"))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
    fn evicted(&mut self) -> anyhow::Result<u64> {
        evictions(&self.1)
    }
}

impl ChurnTarget for RedisTarget {
    fn store(&mut self, id: usize, v: &[u8]) -> anyhow::Result<()> {
        Ok(redis::cmd("SET")
            .arg(format!("churn:k{id}"))
            .arg(v)
            .query::<()>(&mut self.0)?)
    }
    fn retrieve(&mut self, id: usize) -> anyhow::Result<bool> {
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(format!("churn:k{id}"))
            .query(&mut self.0)?;
        Ok(std::hint::black_box(v).is_some())
    }
    fn exists(&mut self, id: usize) -> anyhow::Result<bool> {
        Ok(redis::cmd("EXISTS")
            .arg(format!("churn:k{id}"))
            .query::<i64>(&mut self.0)?
            == 1)
    }
    fn delete(&mut self, id: usize) -> anyhow::Result<()> {
        Ok(redis::cmd("DEL")
            .arg(format!("churn:k{id}"))
            .query::<()>(&mut self.0)?)
    }
    fn evicted(&mut self) -> anyhow::Result<u64> {
        let info: String = redis::cmd("INFO").arg("stats").query(&mut self.0)?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("evicted_keys:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }
}

fn run_churn(
    name: &str,
    t: &mut dyn ChurnTarget,
    prefill: usize,
    ops: &[(Op, usize)],
    value: &[u8],
) -> anyhow::Result<ChurnRow> {
    for id in 0..prefill {
        t.store(id, value)?;
    }
    let ev0 = t.evicted()?;
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); OPS.len()];
    let mut hits = 0;
    let start = Instant::now();
    for &(op, id) in ops {
        let s = Instant::now();
        match op {
            Op::Store => t.store(id, value)?,
            Op::Retrieve => hits += usize::from(t.retrieve(id)?),
            Op::Exists => {
                std::hint::black_box(t.exists(id)?);
            }
            Op::Delete => t.delete(id)?,
        }
        let k = OPS.iter().position(|(o, _)| *o == op).unwrap_or(0);
        lat[k].push(s.elapsed().as_secs_f64() * 1e6);
    }
    let secs = start.elapsed().as_secs_f64();
    let per_op = OPS
        .iter()
        .zip(lat)
        .map(|((_, n), mut v)| {
            v.sort_by(f64::total_cmp);
            (
                n.to_string(),
                v.len(),
                quantile(&v, 0.5),
                quantile(&v, 0.99),
            )
        })
        .collect();
    Ok(ChurnRow {
        system: name.into(),
        ops_per_s: ops.len() as f64 / secs,
        per_op,
        retrieve_hits: hits,
        evicted: t.evicted()? - ev0,
    })
}

/// Churn: a mixed load with eviction active, on a pool of `pool_bytes` filled to 90% with
/// `value_bytes` entries first; Redis gets the same limit as `maxmemory` with allkeys-lru.
pub fn churn(
    dir: &Path,
    pool_bytes: u64,
    value_bytes: usize,
    n_ops: usize,
) -> anyhow::Result<Vec<ChurnRow>> {
    let prefill = (pool_bytes as usize / value_bytes) * 9 / 10;
    let window = prefill * 6 / 5;
    let ops = churn_ops(n_ops, prefill, window);
    let mut value = vec![0u8; value_bytes];
    data::fill(7, &mut value);
    let mut rows = Vec::new();
    for name in ["libmaru", "maru-fs", "redis"] {
        eprintln!("churn: {name}");
        let sub = dir.join(format!("churn-{name}"));
        let row = if name == "redis" {
            let r = Redis::start(&sub, Some(pool_bytes))?;
            run_churn(name, &mut RedisTarget(r.connect()?), prefill, &ops, &value)?
        } else {
            let d = PrivateDaemon::start_with(
                &sub,
                "d",
                &[&format!("memfs:{{dir}}/pool,size={pool_bytes}")],
                true,
                &["--eviction", "lru"],
            )?;
            let h = d.handler("churn")?;
            h.mkdir("churn", 0o755)?;
            if name == "libmaru" {
                run_churn(name, &mut LibTarget(h), prefill, &ops, &value)?
            } else {
                let mnt = d.mount.clone().context("mount")?;
                run_churn(
                    name,
                    &mut FsTarget(mnt.join("churn"), h),
                    prefill,
                    &ops,
                    &value,
                )?
            }
        };
        rows.push(row);
    }
    Ok(rows)
}

/// One metadata operation's rate.
#[derive(Debug, Clone, Serialize)]
pub struct MetaRow {
    /// What was measured.
    pub case: String,
    /// The system.
    pub system: String,
    /// Keys per second.
    pub keys_per_s: f64,
    /// Median and 99th percentile microseconds of one call (a batch counts as one call).
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

fn meta_rate(
    case: &str,
    system: &str,
    calls: usize,
    keys_per_call: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<MetaRow> {
    let mut lat = Vec::with_capacity(calls);
    let start = Instant::now();
    for i in 0..calls {
        let s = Instant::now();
        f(i)?;
        lat.push(s.elapsed().as_secs_f64() * 1e6);
    }
    let secs = start.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    Ok(MetaRow {
        case: case.into(),
        system: system.into(),
        keys_per_s: (calls * keys_per_call) as f64 / secs,
        p50_us: quantile(&lat, 0.5),
        p99_us: quantile(&lat, 0.99),
    })
}

/// Metadata: exists, lookup and batch lookup over `keys` stored keys, maru and Redis.
pub fn metadata(env: &Env, keys: usize, calls: usize) -> anyhow::Result<Vec<MetaRow>> {
    eprintln!("metadata: {keys} keys");
    let h = env.daemon.handler("meta")?;
    h.mkdir("meta", 0o755)?;
    let mut con = env.redis.connect()?;
    let v = vec![1u8; 4096];
    for i in 0..keys {
        h.put(&format!("meta/k{i}"), &v)?;
        redis::cmd("SET")
            .arg(format!("meta:k{i}"))
            .arg(&v[..])
            .query::<()>(&mut con)?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let picks: Vec<usize> = (0..calls.max(64)).map(|_| rng.gen_range(0..keys)).collect();
    let pick = |i: usize| picks[i % picks.len()];
    let dir = env.mount.join("meta");
    let batch = 64;
    let mut rows = vec![
        meta_rate("exists", "libmaru (shared index)", calls, 1, |i| {
            anyhow::ensure!(h.exists(&format!("meta/k{}", pick(i)))?);
            Ok(())
        })?,
        meta_rate("exists", "/maru stat", calls, 1, |i| {
            std::fs::symlink_metadata(dir.join(format!("k{}", pick(i))))?;
            Ok(())
        })?,
        meta_rate("exists", "Redis EXISTS", calls, 1, |i| {
            let n: i64 = redis::cmd("EXISTS")
                .arg(format!("meta:k{}", pick(i)))
                .query(&mut con)?;
            anyhow::ensure!(n == 1);
            Ok(())
        })?,
        meta_rate("lookup (size, location)", "libmaru stat", calls, 1, |i| {
            h.stat(&format!("meta/k{}", pick(i)))?.context("missing")?;
            Ok(())
        })?,
        meta_rate("lookup (size, location)", "Redis STRLEN", calls, 1, |i| {
            let n: i64 = redis::cmd("STRLEN")
                .arg(format!("meta:k{}", pick(i)))
                .query(&mut con)?;
            anyhow::ensure!(n == 4096);
            Ok(())
        })?,
    ];
    let bcalls = (calls / batch).max(10);
    let names: Vec<Vec<String>> = (0..16)
        .map(|b| {
            (0..batch)
                .map(|j| format!("meta/k{}", pick(b * batch + j)))
                .collect()
        })
        .collect();
    rows.push(meta_rate(
        "batch exists (64 keys)",
        "libmaru batch_exists",
        bcalls,
        batch,
        |i| {
            let refs: Vec<&str> = names[i % names.len()].iter().map(String::as_str).collect();
            anyhow::ensure!(h.batch_exists(&refs)?.iter().all(|b| *b));
            Ok(())
        },
    )?);
    rows.push(meta_rate(
        "batch exists (64 keys)",
        "Redis pipelined EXISTS",
        bcalls,
        batch,
        |i| {
            let mut p = redis::pipe();
            for k in &names[i % names.len()] {
                p.cmd("EXISTS").arg(k.replacen('/', ":", 1));
            }
            let r: Vec<i64> = p.query(&mut con)?;
            anyhow::ensure!(r.iter().all(|n| *n == 1));
            Ok(())
        },
    )?);
    let _ = std::fs::remove_dir_all(&dir);
    redis::cmd("FLUSHALL").query::<()>(&mut con)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn churn_ops_mix_and_keys() {
        let ops = churn_ops(10_000, 100, 120);
        let stores = ops.iter().filter(|(o, _)| *o == Op::Store).count();
        assert!((2000..3000).contains(&stores), "{stores}");
        // Stores take new ids in order; other ops pick ids already stored.
        let mut next = 100;
        for (o, id) in &ops {
            if *o == Op::Store {
                assert_eq!(*id, next);
                next += 1;
            } else {
                assert!(*id < next && *id + 120 >= next);
            }
        }
        assert_eq!(ops, churn_ops(10_000, 100, 120), "deterministic");
    }

    #[test]
    fn rounds_permute_the_order() {
        let orders: Vec<Vec<System>> = (0..8).map(rotated).collect();
        for o in &orders {
            let mut s = o.clone();
            s.sort_by_key(|x| System::ALL.iter().position(|y| y == x));
            assert_eq!(s, System::ALL.to_vec(), "a permutation");
        }
        assert_eq!(rotated(3), rotated(3), "reproducible");
        // Over a few rounds, a system does not always follow the same one.
        let after_redis: std::collections::HashSet<_> = orders
            .iter()
            .filter_map(|o| {
                let i = o.iter().position(|s| *s == System::Redis)?;
                o.get(i + 1).copied()
            })
            .collect();
        assert!(after_redis.len() > 1);
    }
}
