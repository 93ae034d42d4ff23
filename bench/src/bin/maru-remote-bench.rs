//! `maru-remote-bench`: the remote tier's figures (doc/REMOTE.md), side by side in one run over
//! one transport. A memory node and two GPU nodes are network namespaces joined by veth pairs
//! (maru_cluster::testing::Net); every process runs as a host of its namespace (its own /sys,
//! so UCX sees the namespace's device) with UCX over TCP on that device. Measured:
//!
//! - 32 MiB stored and retrieved through maru's remote tier against a bare NIXL WRITE and
//!   READ of the same bytes between the same namespaces (the transport's limit here);
//! - 4 KiB remote stores and `exists` per second, `batch_retrieve(64)` against 64 single
//!   retrieves;
//! - 16K tokens of Llama-3.1-8B KV (64 chunks of 32 MiB, 2 GiB) loaded by two workers at once,
//!   against the same chunks fetched from Redis over TCP between the same namespaces.
//!
//! ```text
//! sudo ./target/release/maru-remote-bench [--rounds 8] [--small 2000] [--chunks 64]
//!     [--no-redis] [--out-json F]
//! ```
//!
//! Needs root, iproute2, NIXL (MARU_NIXL_LIB or the nixl-cu12 wheel) and, for the Redis row,
//! redis-server.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use maru_cluster::testing::{Net, enter_host, in_netns};
use maru_nixl::{AgentConfig, Desc, Mem, Nixl, Op};
use maru_remote::{ARENA_ALIGN, Purpose, RemoteClient, RemoteConfig, Stats, Stored};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// 32 MiB transfers each way, per system.
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    /// 4 KiB stores (and as many `exists`).
    #[arg(long, default_value_t = 2000)]
    small: usize,
    /// 32 MiB chunks loaded by each of two workers (64: 16K tokens of Llama-3.1-8B).
    #[arg(long, default_value_t = 64)]
    chunks: usize,
    /// Skip the Redis row.
    #[arg(long)]
    no_redis: bool,
    /// Also write the rows as JSON here.
    #[arg(long = "out-json", value_name = "FILE")]
    out_json: Option<PathBuf>,
}

const CHUNK: usize = 32 << 20;
const PORT: u16 = 7861;
const REDIS_PORT: u16 = 6390;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("__role") {
        return role(&args[2..]);
    }
    let cli = Cli::parse();
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark makes network namespaces and starts marud: run it as root"
    );
    let nixl = match Nixl::locate()? {
        Some(p) => p.to_string_lossy().into_owned(),
        None => "libnixl_capi.so".into(),
    };
    let net = Net::new(3).context("network namespaces (root and iproute2)")?;
    let scratch = tempfile::Builder::new()
        .prefix("maru-remote-bench-")
        .tempdir_in("/dev/shm")?;
    let b = Bench {
        net,
        nixl,
        dir: scratch.path().to_owned(),
    };
    let mut rows: Vec<(String, f64, &str)> = Vec::new();

    // 1. The transport's limit: bare NIXL between the memory node and GPU node 1.
    let md = b.dir.join("target.md");
    let mut target = b.spawn(
        0,
        &["nixl-target", &md.to_string_lossy(), &CHUNK.to_string()],
    )?;
    wait_for(&md, Duration::from_secs(30))?;
    let bare = b.run(
        1,
        &[
            "nixl-initiator",
            &md.to_string_lossy(),
            &CHUNK.to_string(),
            &cli.rounds.to_string(),
        ],
    )?;
    stop(&mut target);

    // 2. maru's remote tier: marud with its door on the memory node.
    // The chunks, the stored and the leased 32 MiB rounds, the warm-up, and room to spare.
    let pool_bytes = (cli.chunks as u64 + 2 * cli.rounds as u64 + 9) * CHUNK as u64 + (256 << 20);
    let mut marud = b.marud(pool_bytes)?;
    let url = format!("{}:{PORT}", b.net.host_ip(0));
    b.wait_door(&url, &mut marud)?;
    let big = b.run(
        1,
        &["big", &url, &CHUNK.to_string(), &cli.rounds.to_string()],
    )?;
    let small = b.run(1, &["small", &url, &cli.small.to_string()])?;

    // 3. 2 GiB loaded by two workers at once, from maru and from Redis.
    b.run(1, &["fill", &url, &cli.chunks.to_string()])?;
    let maru_two = b.both(&["load", &url, &cli.chunks.to_string()])?;
    stop(&mut marud);
    let redis_two = if cli.no_redis {
        None
    } else {
        Some(b.redis_two(cli.chunks)?)
    };

    let gbps = |bytes: f64, secs: f64| bytes / secs / 1e9;
    let chunk_bytes = (CHUNK * cli.rounds) as f64;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let bare_w = gbps(chunk_bytes, f(&bare, "write_s"));
    let bare_r = gbps(chunk_bytes, f(&bare, "read_s"));
    let maru_w = gbps(chunk_bytes, f(&big, "store_s"));
    let maru_r = gbps(chunk_bytes, f(&big, "retrieve_s"));
    let mut line = |case: &str, value: f64, unit: &'static str| {
        rows.push((case.to_owned(), value, unit));
    };
    line("32 MiB WRITE, bare NIXL", bare_w, "GB/s");
    line("32 MiB store, maru remote", maru_w, "GB/s");
    line("  store / bare WRITE", maru_w / bare_w, "x");
    let maru_l = gbps(chunk_bytes, f(&big, "leased_s"));
    line("32 MiB store from a lease (no copy)", maru_l, "GB/s");
    line("  leased store / bare WRITE", maru_l / bare_w, "x");
    line("32 MiB READ, bare NIXL", bare_r, "GB/s");
    line("32 MiB retrieve, maru remote", maru_r, "GB/s");
    line("  retrieve / bare READ", maru_r / bare_r, "x");
    let maru_lr = gbps(chunk_bytes, f(&big, "leased_read_s"));
    line("32 MiB retrieve into a lease (no copy)", maru_lr, "GB/s");
    line("  leased retrieve / bare READ", maru_lr / bare_r, "x");
    line(
        "4 KiB store (reserve+WRITE+publish)",
        f(&small, "store_per_s"),
        "/s",
    );
    line("4 KiB exists", f(&small, "exists_per_s"), "/s");
    let batch = f(&small, "batch64_per_s");
    let singles = f(&small, "single_per_s");
    line("batch_retrieve(64), entries", batch, "/s");
    line("64 single retrieves, entries", singles, "/s");
    line("  batch / singles", batch / singles, "x");
    let two_gib = (2 * CHUNK * cli.chunks) as f64;
    let mt = f(&maru_two, "wall_s");
    line("2 workers x 2 GiB, maru remote", mt, "s");
    line("  aggregate", gbps(two_gib, mt), "GB/s");
    if let Some(r) = &redis_two {
        let rt = f(r, "wall_s");
        line("2 workers x 2 GiB, Redis GET", rt, "s");
        line("  aggregate", gbps(two_gib, rt), "GB/s");
        line("  Redis time / maru time", rt / mt, "x");
    }
    println!(
        "\n## remote tier: UCX/TCP over veth between network namespaces (memory node, GPU \
         nodes)\n\n| case | value | unit |\n|---|---:|---|"
    );
    for (case, value, unit) in &rows {
        let shown = if *value >= 100.0 {
            format!("{value:.0}")
        } else {
            format!("{value:.3}")
        };
        println!("| {case} | {shown} | {unit} |");
    }
    // Where one call's time went, in milliseconds per call.
    println!(
        "\n### where a 32 MiB call's time goes (ms per call)\n\n| call | total | control \
         replies | NIXL transfer | staging copy | the rest |\n|---|---:|---:|---:|---:|---:|"
    );
    let per = 1e3 / cli.rounds as f64;
    let bare_write_ms = f(&bare, "write_s") * per;
    let bare_read_ms = f(&bare, "read_s") * per;
    println!("| bare NIXL WRITE | {bare_write_ms:.1} | | {bare_write_ms:.1} | | |");
    println!("| bare NIXL READ | {bare_read_ms:.1} | | {bare_read_ms:.1} | | |");
    for (name, total, ph) in [
        ("store", "store_s", "store_phases"),
        ("store from a lease", "leased_s", "leased_phases"),
        ("retrieve_into", "retrieve_s", "retrieve_phases"),
        (
            "retrieve into a lease",
            "leased_read_s",
            "leased_read_phases",
        ),
    ] {
        let (t, p) = (f(&big, total) * per, &big[ph]);
        let (c, x, y) = (
            f(p, "control_s") * per,
            f(p, "transfer_s") * per,
            f(p, "copy_s") * per,
        );
        println!(
            "| {name} | {t:.1} | {c:.1} | {x:.1} | {y:.1} | {:.1} |",
            t - c - x - y
        );
    }
    if let Some(p) = &cli.out_json {
        let all = json!({
            "rows": rows, "bare": bare, "big": big, "small": small, "maru_two": maru_two,
            "redis_two": redis_two,
        });
        std::fs::write(p, serde_json::to_vec_pretty(&all)?)?;
    }
    drop(scratch);
    Ok(())
}

struct Bench {
    net: Net,
    nixl: String,
    dir: PathBuf,
}

impl Bench {
    fn env(&self, host: usize) -> Vec<(String, String)> {
        vec![
            ("MARU_NIXL_LIB".into(), self.nixl.clone()),
            ("UCX_TLS".into(), "tcp".into()),
            ("UCX_NET_DEVICES".into(), self.net.host_dev(host)),
            ("UCX_MODULES".into(), "^ib".into()),
            ("MARU_LOG".into(), "warn".into()),
        ]
    }

    /// `cmd` as a host of namespace `host`.
    fn host_cmd(&self, host: usize, program: &Path, args: &[&str]) -> anyhow::Result<Command> {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(self.env(host))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        let ns = std::fs::File::open(self.net.host_path(host))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
        // SAFETY: enter_host and prctl make system calls only; the namespace's file stays open
        // (moved into the closure) until exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                let _keep = &ns;
                enter_host(fd)?;
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        Ok(cmd)
    }

    fn role_cmd(&self, host: usize, args: &[&str]) -> anyhow::Result<Command> {
        let me = std::env::current_exe()?;
        let mut all = vec!["__role"];
        all.extend_from_slice(args);
        self.host_cmd(host, &me, &all)
    }

    fn spawn(&self, host: usize, args: &[&str]) -> anyhow::Result<Child> {
        Ok(self.role_cmd(host, args)?.stdout(Stdio::piped()).spawn()?)
    }

    /// Runs a role to its end: its last JSON line.
    fn run(&self, host: usize, args: &[&str]) -> anyhow::Result<Value> {
        let child = self.spawn(host, args)?;
        result(child, args[0])
    }

    /// The same role on GPU nodes 1 and 2 at once; the wall time until both finished.
    fn both(&self, args: &[&str]) -> anyhow::Result<Value> {
        let t = Instant::now();
        let (a, b) = (self.spawn(1, args)?, self.spawn(2, args)?);
        let (ra, rb) = (result(a, args[0])?, result(b, args[0])?);
        Ok(json!({"wall_s": t.elapsed().as_secs_f64(), "workers": [ra, rb]}))
    }

    fn marud(&self, pool_bytes: u64) -> anyhow::Result<Child> {
        let marud = maru_tools::env::sibling("marud")?;
        let d = self.dir.join("marud");
        std::fs::create_dir_all(&d)?;
        let pool = format!("file:{}/pool.img,size={pool_bytes}", d.display());
        let bind = format!("{}:{PORT}", self.net.host_ip(0));
        let (sock, state) = (d.join("marud.sock"), d.join("state"));
        let args = [
            "--pool",
            &pool,
            "--no-mount",
            "--socket",
            &sock.to_string_lossy(),
            "--state-dir",
            &state.to_string_lossy(),
            "--eviction",
            "off",
            "--remote-bind",
            &bind,
            "--remote-anonymous",
            "0:0",
        ];
        Ok(self
            .host_cmd(0, &marud, &args)?
            .stdout(Stdio::null())
            .spawn()?)
    }

    fn wait_door(&self, url: &str, marud: &mut Child) -> anyhow::Result<()> {
        let t = Instant::now();
        loop {
            let url = url.to_owned();
            if in_netns(&self.net.hosts[1], move || {
                std::net::TcpStream::connect(url).is_ok()
            }) {
                return Ok(());
            }
            if let Some(st) = marud.try_wait()? {
                anyhow::bail!("marud exited ({st})");
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(30),
                "the door did not open"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Redis on the memory node holding the same chunks; two GPU nodes GET them all at once.
    fn redis_two(&self, chunks: usize) -> anyhow::Result<Value> {
        let ip = self.net.host_ip(0);
        let mut server = self
            .host_cmd(
                0,
                Path::new("redis-server"),
                &[
                    "--bind",
                    &ip,
                    "--port",
                    &REDIS_PORT.to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                    "--proto-max-bulk-len",
                    "64mb",
                ],
            )?
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server (apt-get install redis-server)")?;
        let url = format!("redis://{ip}:{REDIS_PORT}/");
        let fill = {
            let url = url.clone();
            in_netns(&self.net.hosts[0], move || -> anyhow::Result<()> {
                let t = Instant::now();
                let mut con = loop {
                    match redis::Client::open(url.as_str())?.get_connection() {
                        Ok(c) => break c,
                        Err(_) if t.elapsed() < Duration::from_secs(20) => {
                            std::thread::sleep(Duration::from_millis(50))
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                for i in 0..chunks {
                    let v = chunk(i);
                    redis::cmd("SET")
                        .arg(format!("kv-{i}"))
                        .arg(v)
                        .query::<()>(&mut con)?;
                }
                Ok(())
            })
        };
        let out = fill.and_then(|()| self.both(&["redis-load", &url, &chunks.to_string()]));
        stop(&mut server);
        out
    }
}

/// The bytes of chunk `i` (distinct per chunk, cheap to make).
fn chunk(i: usize) -> Vec<u8> {
    let mut v = vec![0u8; CHUNK];
    for (j, w) in v.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&((i as u64) << 40 | j as u64).to_le_bytes());
    }
    v
}

fn result(mut child: Child, what: &str) -> anyhow::Result<Value> {
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("stdout")?
        .read_to_string(&mut out)?;
    let st = child.wait()?;
    anyhow::ensure!(st.success(), "role {what} failed ({st}): {out}");
    let last = out.lines().last().context("no result")?;
    Ok(serde_json::from_str(last)?)
}

fn stop(c: &mut Child) {
    maru_tools::env::stop_child(c, Duration::from_secs(5));
}

fn wait_for(p: &Path, within: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    while !p.exists() {
        anyhow::ensure!(t.elapsed() < within, "{} did not appear", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Seconds spent in each phase between two readings of a client's counters.
fn phases(before: &Stats, after: &Stats) -> Value {
    json!({
        "control_s": (after.control_time - before.control_time).as_secs_f64(),
        "transfer_s": (after.transfer_time - before.transfer_time).as_secs_f64(),
        "copy_s": (after.copy_time - before.copy_time).as_secs_f64(),
        "requests": after.requests - before.requests,
    })
}

fn say(v: Value) {
    println!("{v}");
}

fn client(url: &str) -> anyhow::Result<RemoteClient> {
    Ok(RemoteClient::connect(RemoteConfig {
        url: url.to_owned(),
        node: format!("bench-{}", std::process::id()),
        transfer_timeout: Duration::from_secs(30),
        staging_bytes: 64 << 20,
        ..Default::default()
    })?)
}

/// The processes of the benchmark, each in its namespace.
fn role(args: &[String]) -> anyhow::Result<()> {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.as_slice() {
        ["nixl-target", md, size] => nixl_target(Path::new(md), size.parse()?),
        ["nixl-initiator", md, size, rounds] => {
            nixl_initiator(Path::new(md), size.parse()?, rounds.parse()?)
        }
        ["big", url, size, rounds] => {
            let c = client(url)?;
            let (size, rounds): (usize, usize) = (size.parse()?, rounds.parse()?);
            let values: Vec<Vec<u8>> = (0..rounds).map(chunk).collect();
            // One warm-up, as the bare baseline has (UCX connects on the first transfer).
            c.store("bench", "warm", &values[0][..size])?;
            let before = c.stats();
            let t = Instant::now();
            for (i, v) in values.iter().enumerate() {
                c.store("bench", &format!("big-{i}"), &v[..size])?;
            }
            let store_s = t.elapsed().as_secs_f64();
            let stored = phases(&before, &c.stats());
            // The same stores from registered memory (a lease of the worker's arena, as a
            // worker that computes into it): no staging copy.
            let arena = c.arena(size.next_multiple_of(ARENA_ALIGN), 0)?;
            let mut lease = arena
                .lease(size, Purpose::Store)
                .context("a lease of the whole arena")?;
            lease.bytes_mut().copy_from_slice(&values[0][..size]);
            let before = c.stats();
            let t = Instant::now();
            for i in 0..rounds {
                let got = c.store_leased("bench", &[(&format!("leased-{i}"), &lease, size)])?;
                anyhow::ensure!(
                    matches!(got.as_slice(), [Ok(Stored::Created)]),
                    "leased-{i}: {got:?}"
                );
            }
            let leased_s = t.elapsed().as_secs_f64();
            let leased = phases(&before, &c.stats());
            let mut dst = vec![0u8; size];
            let before = c.stats();
            let t = Instant::now();
            for i in 0..rounds {
                let n = c.retrieve_into("bench", &format!("big-{i}"), &mut dst)?;
                anyhow::ensure!(n == Some(size), "big-{i}: {n:?}");
            }
            let retrieve_s = t.elapsed().as_secs_f64();
            let retrieved = phases(&before, &c.stats());
            anyhow::ensure!(dst[..] == values[rounds - 1][..size], "bytes differ");
            // The same loads into registered memory (new leases of the arena): no copy out.
            drop(lease);
            let before = c.stats();
            let t = Instant::now();
            for i in 0..rounds {
                let got = c.retrieve_leased("bench", &[&format!("big-{i}")], &arena)?;
                anyhow::ensure!(
                    matches!(got.as_slice(), [Some(l)] if l.len() >= size),
                    "big-{i}: not loaded"
                );
            }
            let leased_read_s = t.elapsed().as_secs_f64();
            let leased_read = phases(&before, &c.stats());
            say(json!({
                "store_s": store_s, "leased_s": leased_s, "retrieve_s": retrieve_s,
                "leased_read_s": leased_read_s, "store_phases": stored, "leased_phases": leased,
                "retrieve_phases": retrieved, "leased_read_phases": leased_read,
            }));
            Ok(())
        }
        ["small", url, n] => {
            let c = client(url)?;
            let n: usize = n.parse()?;
            let v = vec![7u8; 4096];
            c.store("small", "warm", &v)?;
            let t = Instant::now();
            for i in 0..n {
                c.store("small", &format!("s-{i}"), &v)?;
            }
            let store_per_s = n as f64 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            for i in 0..n {
                anyhow::ensure!(c.exists("small", &format!("s-{i}"))?, "s-{i} missing");
            }
            let exists_per_s = n as f64 / t.elapsed().as_secs_f64();
            let keys: Vec<String> = (0..64).map(|i| format!("s-{i}")).collect();
            let names: Vec<&str> = keys.iter().map(String::as_str).collect();
            let reps = (n / 64).clamp(4, 64);
            let t = Instant::now();
            for _ in 0..reps {
                let got = c.batch_retrieve("small", &names)?;
                anyhow::ensure!(got.iter().all(Option::is_some), "a batch missed");
            }
            let batch64_per_s = (reps * 64) as f64 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            for _ in 0..reps {
                for k in &names {
                    anyhow::ensure!(c.retrieve("small", k)?.is_some(), "{k} missed");
                }
            }
            let single_per_s = (reps * 64) as f64 / t.elapsed().as_secs_f64();
            say(json!({
                "store_per_s": store_per_s, "exists_per_s": exists_per_s,
                "batch64_per_s": batch64_per_s, "single_per_s": single_per_s,
            }));
            Ok(())
        }
        ["fill", url, chunks] => {
            let c = client(url)?;
            for i in 0..chunks.parse::<usize>()? {
                c.store("kv", &format!("kv-{i}"), &chunk(i))?;
            }
            say(json!({"filled": true}));
            Ok(())
        }
        ["load", url, chunks] => {
            let c = client(url)?;
            let mut dst = vec![0u8; CHUNK];
            let t = Instant::now();
            let mut sum = 0u64;
            for i in 0..chunks.parse::<usize>()? {
                let n = c.retrieve_into("kv", &format!("kv-{i}"), &mut dst)?;
                anyhow::ensure!(n == Some(CHUNK), "kv-{i}: {n:?}");
                sum = sum.wrapping_add(u64::from(dst[CHUNK - 1]));
            }
            say(json!({"load_s": t.elapsed().as_secs_f64(), "sum": sum}));
            Ok(())
        }
        ["redis-load", url, chunks] => {
            let mut con = redis::Client::open(*url)?.get_connection()?;
            let t = Instant::now();
            let mut sum = 0u64;
            for i in 0..chunks.parse::<usize>()? {
                let v: Vec<u8> = redis::cmd("GET").arg(format!("kv-{i}")).query(&mut con)?;
                anyhow::ensure!(v.len() == CHUNK, "kv-{i}: {} bytes", v.len());
                sum = sum.wrapping_add(u64::from(v[CHUNK - 1]));
            }
            say(json!({"load_s": t.elapsed().as_secs_f64(), "sum": sum}));
            Ok(())
        }
        _ => anyhow::bail!("unknown role {a:?}"),
    }
}

/// A NIXL agent with a registered buffer whose metadata and address it writes to `md` (the
/// address on the first line, the metadata after it), then waits to be stopped.
fn nixl_target(md: &Path, size: usize) -> anyhow::Result<()> {
    let nixl = Nixl::load()?;
    let mut agent = nixl.agent("bench-target", &AgentConfig::default())?;
    agent.add_backend("UCX", &[])?;
    let buf = vec![1u8; size];
    agent.register(Mem::Dram, &[Desc::host(buf.as_ptr() as u64, size as u64)])?;
    let mut out = format!("{}\n", buf.as_ptr() as u64).into_bytes();
    out.extend(agent.metadata()?);
    let tmp = md.with_extension("tmp");
    std::fs::write(&tmp, out)?;
    std::fs::rename(&tmp, md)?;
    // Until the parent stops it (or dies: PDEATHSIG).
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    std::thread::sleep(Duration::from_secs(3600));
    drop(buf);
    Ok(())
}

/// WRITE and READ of `size` bytes `rounds` times each into the target's buffer.
fn nixl_initiator(md: &Path, size: usize, rounds: usize) -> anyhow::Result<()> {
    let raw = std::fs::read(md)?;
    let nl = raw.iter().position(|&b| b == b'\n').context("md file")?;
    let addr: u64 = std::str::from_utf8(&raw[..nl])?.parse()?;
    let nixl = Nixl::load()?;
    let mut agent = nixl.agent("bench-initiator", &AgentConfig::default())?;
    agent.add_backend("UCX", &[])?;
    let buf = chunk(3);
    let local = [Desc::host(buf.as_ptr() as u64, size as u64)];
    agent.register(Mem::Dram, &local)?;
    let peer = agent.load_peer(&raw[nl + 1..])?;
    let remote = [Desc::host(addr, size as u64)];
    let go = |op: Op| -> anyhow::Result<f64> {
        // One warm-up (connection set-up), then the timed rounds.
        agent
            .transfer(op, Mem::Dram, &local, Mem::Dram, &remote, &peer)?
            .wait(Duration::from_secs(60))?;
        let t = Instant::now();
        for _ in 0..rounds {
            agent
                .transfer(op, Mem::Dram, &local, Mem::Dram, &remote, &peer)?
                .wait(Duration::from_secs(60))?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let write_s = go(Op::Write)?;
    let read_s = go(Op::Read)?;
    say(json!({"write_s": write_s, "read_s": read_s}));
    Ok(())
}
