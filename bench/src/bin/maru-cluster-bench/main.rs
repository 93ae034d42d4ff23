//! `maru-cluster-bench`: several hosts sharing one pool (cluster mode, doc/CLUSTER.md).
//! Three marud processes (hosts a, b, c) on one `file:` pool in a tmpfs (the stand-in for a
//! CXL device) and a private etcd on loopback; the TCP baseline runs between network
//! namespaces. The figures are issue 19's targets, side by side in one run.
//!
//!     sudo ./target/release/maru-cluster-bench [--rounds 200] [--chunks 64] [--pages 2m|4k]
//!         [--out-json F]
//!     sudo ./target/release/maru-cluster-bench --stores-only [--runs 3] [--before OLD/marud]
//!         [--wal-sync]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;

use maru_tools::bench::{Row, TcpPeer, fmt_table, rate, scratch, timed, touch};
use maru_tools::env::PrivateDaemon;

mod stores;

/// Three hosts sharing one pool, against issue 19's targets (needs root and etcd).
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Publications, visibility samples and 32 MiB samples.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// 32 MiB chunks of KV stored on a and read once on b and c (64: 16K tokens of
    /// Llama-3.1-8B).
    #[arg(long, default_value_t = 64)]
    chunks: usize,
    /// The pages of the tmpfs holding the pool file: `2m` (a tmpfs of the benchmark's own,
    /// `huge=always`: mapped in 2 MiB pages, as a devdax device is) or `4k` (/dev/shm).
    #[arg(long, default_value = "2m", value_parser = ["2m", "4k"])]
    pages: String,
    /// Also write the rows as JSON here.
    #[arg(long = "out-json", value_name = "FILE")]
    out_json: Option<PathBuf>,
    /// Only the rates of small stores in cluster mode (issue 35's targets).
    #[arg(long)]
    stores_only: bool,
    /// With --stores-only: runs, alternated between the builds.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// With --stores-only: another build's marud, measured alongside this one's.
    #[arg(long, value_name = "MARUD")]
    before: Option<PathBuf>,
    /// With --stores-only: marud syncs its pool's log at each record (`--wal-sync`; the log
    /// in the benchmark's scratch directory, on disk).
    #[arg(long)]
    wal_sync: bool,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("__tcp-serve") {
        // The TCP baseline's sender (TcpPeer runs this binary again).
        let size = args.get(2).context("size")?.parse()?;
        return maru_tools::bench::tcp_serve_main(size);
    }
    let cli = Cli::parse();
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark starts marud on a shared pool and network namespaces: run it as root"
    );
    if cli.stores_only {
        print!(
            "{}",
            stores::stores(cli.rounds, cli.runs, cli.before.as_deref(), cli.wal_sync)?
        );
        return Ok(());
    }
    print!(
        "{}",
        cluster(
            cli.rounds,
            cli.chunks,
            cli.pages == "2m",
            cli.out_json.as_deref()
        )?
    );
    Ok(())
}

/// 16K tokens of Llama-3.1-8B in bf16: 128 KiB per token, in 256-token chunks of 32 MiB.
const CHUNK: usize = 32 << 20;

/// Reads every byte (8 at a time), so that nothing is left unread or optimized away.
fn read_all(bytes: &[u8]) -> u64 {
    let mut acc = 0u64;
    for c in bytes.chunks_exact(8) {
        acc = acc.wrapping_add(u64::from_ne_bytes(c.try_into().expect("8 bytes")));
    }
    std::hint::black_box(acc)
}

/// Where the pool file lives: a tmpfs of its own in 2 MiB pages (unmounted when dropped), or
/// a directory in /dev/shm (4 KiB pages).
/// A pool file of `size` bytes at `path`, its header written once as on a real device; its
/// `--pool` spec.
fn pool_file(path: &Path, size: u64) -> anyhow::Result<String> {
    let f = std::fs::File::create(path)?;
    f.set_len(size)?;
    maru::format::init_header(&f)?;
    Ok(format!("file:{},size={size}", path.display()))
}

struct PoolDir {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl PoolDir {
    fn new(huge: bool, size: u64) -> anyhow::Result<PoolDir> {
        let prefix = "maru-cluster-pool-";
        if !huge {
            let dir = tempfile::Builder::new()
                .prefix(prefix)
                .tempdir_in("/dev/shm")?;
            return Ok(PoolDir {
                dir,
                mounted: false,
            });
        }
        let dir = tempfile::Builder::new().prefix(prefix).tempdir()?;
        let opts = format!("size={size},huge=always,mode=0700");
        nix::mount::mount(
            Some("maru-bench"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            Some(opts.as_str()),
        )
        .context("mounting a tmpfs for the pool")?;
        Ok(PoolDir { dir, mounted: true })
    }
}

impl Drop for PoolDir {
    fn drop(&mut self) {
        if self.mounted
            && let Err(e) = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH)
        {
            eprintln!("unmounting {}: {e}", self.dir.path().display());
        }
    }
}

fn quantile(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn cluster(
    rounds: usize,
    chunks: usize,
    huge: bool,
    json: Option<&Path>,
) -> anyhow::Result<String> {
    anyhow::ensure!(
        rounds >= 2 && chunks >= 1,
        "--rounds >= 2 and --chunks >= 1"
    );
    let etcd = maru_cluster::testing::Etcd::start()
        .context("cluster mode needs etcd: apt-get install etcd-server")?;
    let tmp = scratch()?;
    // The shared pool: a file in a tmpfs, its header written once as on a real device.
    let size = (chunks as u64 * CHUNK as u64) * 5 / 4 + (512 << 20);
    let shm = PoolDir::new(huge, size + (64 << 20))?;
    let spec = pool_file(&shm.dir.path().join("cxl.img"), size)?;
    let eps = etcd.endpoints().join(",");
    let host = |name: &str| {
        PrivateDaemon::start_with(
            tmp.path(),
            name,
            &[spec.as_str()],
            false,
            &["--cluster", &eps, "--node", name, "--eviction", "off"],
        )
    };
    let (a, b, c) = (host("a")?, host("b")?, host("c")?);
    let (ha, hb, hc) = (a.handler("kv")?, b.handler("kv")?, c.handler("kv")?);
    ha.mkdir("kv", 0o755)?;
    let small = vec![0x5au8; 4096];

    // Publication on a, and visibility on b: each store, then b asked until it answers yes.
    ha.put("kv/first", &small)?;
    while !hb.exists("kv/first").unwrap_or(false) {
        std::thread::yield_now();
    }
    let (mut publish, mut visible) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let key = format!("kv/p{i}");
        let mut h = ha.alloc(small.len() as u64)?;
        h.as_mut_slice().copy_from_slice(&small);
        let t = Instant::now();
        ha.store(&key, h)?;
        let stored = Instant::now();
        publish.push(stored - t);
        while !hb.exists(&key)? {
            std::hint::spin_loop();
        }
        visible.push(stored.elapsed());
    }
    let mut rows = vec![
        timed("publication on a (store of 4 KiB, waits)", publish.clone()),
        timed(
            "visibility: a's store returned -> b's index says yes",
            visible.clone(),
        ),
    ];
    let (pub_p50, vis_p99) = (quantile(&mut publish, 0.5), quantile(&mut visible, 0.99));

    // What a first retrieve of another host's entry costs: b asks nothing of etcd (a removal
    // is acknowledged by every host before its extent is freed), so as much as a's of its own;
    // then again on b.
    let (mut first_a, mut first_b, mut again_b) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let key = format!("kv/p{i}");
        for (h, out) in [
            (&ha, &mut first_a),
            (&hb, &mut first_b),
            (&hb, &mut again_b),
        ] {
            h.trim();
            let t = Instant::now();
            let m = h.retrieve(&key)?.context("missing")?;
            out.push(t.elapsed());
            read_all(&m);
        }
    }
    rows.push(timed("4 KiB first retrieve on a (its own)", first_a));
    rows.push(timed(
        "4 KiB first retrieve on b (a's entry; nothing asked of etcd)",
        first_b,
    ));
    rows.push(timed("4 KiB retrieve again on b", again_b));

    // What that moves to a removal: its extent is free once b and c acknowledged it. A delete
    // returns after its etcd transaction (the extent comes back in the background); an
    // eviction, which wants the space now, waits for the acknowledgements. b's mappings are
    // released first: no hold.
    hb.trim();
    hb.stats()?;
    let mut deletes = Vec::with_capacity(rounds / 2);
    for i in 0..rounds / 2 {
        let t = Instant::now();
        ha.delete(&format!("kv/p{i}"))?;
        deletes.push(t.elapsed());
    }
    rows.push(timed(
        "delete on a of an entry b read (its etcd transaction)",
        deletes,
    ));
    let mut evictions = Vec::with_capacity(rounds / 2);
    for _ in rounds / 2..rounds {
        let p = ha.stats()?.pools.swap_remove(0);
        let t = Instant::now();
        let (n, _) = ha.evict(p.capacity - p.used + 1)?;
        evictions.push(t.elapsed());
        anyhow::ensure!(n == 1, "evicted {n} entries, not one");
    }
    rows.push(timed(
        "eviction on a of one entry b read (until b and c acknowledged it)",
        evictions,
    ));

    // exists on b of an entry of a: the local index.
    let n = 1_000_000u64;
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(hb.exists("kv/first")?);
    }
    rows.push(rate("exists on b of a's entry", n, t.elapsed()));

    // A 32 MiB entry retrieved (first time, every byte read) by a reader on b and a reader on
    // a, alternating; both are clients other than the writer, whose own mapping has the pages
    // from writing them (its retrieve is shown apart).
    let payload = vec![0xa5u8; CHUNK];
    let samples = rounds.clamp(3, 21);
    let ra = a.handler("kv")?;
    let (mut on_a, mut on_b, mut again_b, mut writer) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..samples {
        let key = format!("kv/big{i}");
        ha.put(&key, &payload)?;
        while !hb.exists(&key)? {
            std::thread::yield_now();
        }
        let order: [(&maru::Handler, &mut Vec<Duration>); 3] = if i % 2 == 0 {
            [(&hb, &mut on_b), (&ra, &mut on_a), (&ha, &mut writer)]
        } else {
            [(&ra, &mut on_a), (&hb, &mut on_b), (&ha, &mut writer)]
        };
        for (h, out) in order {
            h.trim();
            let t = Instant::now();
            let m = h.retrieve(&key)?.context("missing")?;
            read_all(&m);
            out.push(t.elapsed());
        }
        // Again on b, the pages warm from the first time.
        hb.trim();
        let t = Instant::now();
        let m = hb.retrieve(&key)?.context("missing")?;
        read_all(&m);
        again_b.push(t.elapsed());
    }
    rows.push(timed(
        "32 MiB first retrieve + read, by its writer on a (pages mapped from writing)",
        writer,
    ));
    rows.push(timed(
        "32 MiB first retrieve + read, by another client on a",
        on_a.clone(),
    ));
    rows.push(timed(
        "32 MiB first retrieve + read, on b (stored on a)",
        on_b.clone(),
    ));
    rows.push(timed(
        "32 MiB retrieve + read again on b (mapping dropped)",
        again_b,
    ));
    let ratio_b_a = quantile(&mut on_b, 0.5).as_secs_f64() / quantile(&mut on_a, 0.5).as_secs_f64();

    // 16K tokens of KV stored on a, read once on b and on c (at once), against the same bytes
    // received over loopback TCP by two readers.
    let keys: Vec<String> = (0..chunks).map(|i| format!("kv/ctx-{i}")).collect();
    let t = Instant::now();
    for k in &keys {
        ha.put(k, &payload)?;
    }
    let store_t = t.elapsed();
    let last = keys.last().expect("chunks >= 1");
    for h in [&hb, &hc] {
        while !h.exists(last)? {
            std::thread::yield_now();
        }
    }
    // Until addressable (every chunk mapped, one byte of every page touched), then, with
    // fresh mappings, until read once (every byte read).
    let visit = |h: &maru::Handler, every_byte: bool| -> anyhow::Result<()> {
        h.trim();
        for k in &keys {
            let m = h.retrieve(k)?.context("missing")?;
            if every_byte {
                read_all(&m);
            } else {
                touch(&m);
            }
        }
        Ok(())
    };
    // Both readers at once; each way twice, alternating, the best of each kept.
    let both = |every_byte: bool| -> anyhow::Result<Duration> {
        let t = Instant::now();
        std::thread::scope(|s| -> anyhow::Result<()> {
            let rb = s.spawn(|| visit(&hb, every_byte));
            let rc = s.spawn(|| visit(&hc, every_byte));
            rb.join().expect("reader b")?;
            rc.join().expect("reader c")
        })?;
        Ok(t.elapsed())
    };
    let (mut addressable_t, mut maru_t) = (Duration::MAX, Duration::MAX);
    for _ in 0..2 {
        addressable_t = addressable_t.min(both(false)?);
        maru_t = maru_t.min(both(true)?);
    }
    // TCP between hosts: a sender in host a's network namespace, readers in b's and c's, on
    // veth pairs through the hub (as in the cluster tests).
    let net =
        maru_cluster::testing::Net::new(3).context("network namespaces need root and iproute2")?;
    let server_ns = net.host_path(0);
    let server_ip: std::net::IpAddr = net.host_ip(0).parse()?;
    let start = std::sync::Barrier::new(2);
    let tcp_reader = |i: usize| -> anyhow::Result<Duration> {
        maru_cluster::testing::in_netns(&net.hosts[i], || {
            let mut p = TcpPeer::start_between(CHUNK, Some(&server_ns), server_ip)?;
            let mut buf = vec![0u8; CHUNK];
            start.wait();
            let t = Instant::now();
            for _ in 0..chunks {
                p.fetch(&mut buf)?;
                read_all(&buf);
            }
            Ok(t.elapsed())
        })
    };
    let tcp_t = std::thread::scope(|s| -> anyhow::Result<Duration> {
        let rb = s.spawn(|| tcp_reader(1));
        let rc = s.spawn(|| tcp_reader(2));
        Ok(rb
            .join()
            .expect("reader b")?
            .max(rc.join().expect("reader c")?))
    })?;
    drop(net);
    let gib = (chunks * CHUNK) as f64 / (1u64 << 30) as f64;
    let mut big = vec![
        rate(
            &format!("store {gib:.2} GiB of KV on a (32 MiB chunks)"),
            chunks as u64,
            store_t,
        ),
        rate(
            "until addressable on b and c at once (chunks, both readers)",
            2 * chunks as u64,
            addressable_t,
        ),
        rate(
            "read once on b and c at once (chunks, both readers)",
            2 * chunks as u64,
            maru_t,
        ),
        rate(
            "TCP from a's namespace to b's and c's (veth), into a buffer, read once (chunks)",
            2 * chunks as u64,
            tcp_t,
        ),
    ];
    rows.append(&mut big);

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out = String::from("# maru-cluster-bench\n");
    out.push_str(&format!(
        "\nThree marud processes (hosts a, b, c) on one `file:` pool in a tmpfs ({}), etcd on \
         loopback; {rounds} rounds; this machine ({cpus} CPUs).\n",
        if huge { "2 MiB pages" } else { "4 KiB pages" }
    ));
    out.push_str(&fmt_table("Measured", &rows));
    let check = |ok: bool| if ok { "met" } else { "NOT met" };
    let tcp_ratio = tcp_t.as_secs_f64() / maru_t.as_secs_f64();
    let tcp_ratio_addr = tcp_t.as_secs_f64() / addressable_t.as_secs_f64();
    let exists_rate = rows
        .iter()
        .find(|r| r.case.starts_with("exists on b"))
        .map_or(0.0, |r| r.per_sec);
    out.push_str(&format!(
        "\n## Targets (issue 19)\n\n| target | measured | |\n|---|---:|---|\n\
         | 32 MiB stored on a, retrieved on b: <= 1.3x the same on a | {ratio_b_a:.2}x | {} |\n\
         | `exists` on b of an entry of a: >= 1 M/s | {:.2} M/s | {} |\n\
         | visibility p99 <= 20 ms | {:.3} ms | {} |\n\
         | publication p50 <= 2 ms | {:.3} ms | {} |\n\
         | {gib:.2} GiB read once on b and c against TCP: >= 10x | {tcp_ratio:.1}x | {} |\n\
         | (the same until addressable, for reference) | {tcp_ratio_addr:.1}x | |\n",
        check(ratio_b_a <= 1.3),
        exists_rate / 1e6,
        check(exists_rate >= 1e6),
        vis_p99.as_secs_f64() * 1e3,
        check(vis_p99 <= Duration::from_millis(20)),
        pub_p50.as_secs_f64() * 1e3,
        check(pub_p50 <= Duration::from_millis(2)),
        check(tcp_ratio >= 10.0),
    ));
    if let Some(p) = json {
        let all: Vec<&Row> = rows.iter().collect();
        std::fs::write(p, serde_json::to_vec_pretty(&all)?)?;
    }
    drop((ha, hb, hc));
    drop((a, b, c));
    drop(etcd);
    Ok(out)
}
