//! Benchmarks measured side by side in one run: `maructl bench core` (the store and
//! libmaru against memcpy, direct mapping and a bare socket round trip) and
//! `maructl bench fs` (retrieval through /maru against direct mapping, read() through a
//! copying FUSE server and a loopback TCP transfer).

pub mod stall;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::env::{PrivateDaemon, Tmpfs, sibling};

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured.
    pub case: String,
    /// Median time of one operation, in microseconds (for timed cases).
    pub median_us: f64,
    /// 10th and 90th percentiles.
    pub p10_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// Operations (or keys) per second, for rate cases.
    pub per_sec: f64,
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize].as_secs_f64() * 1e6;
    (q(0.5), q(0.1), q(0.9))
}

/// A row of per-operation times (median, p10, p90).
pub fn timed(case: &str, v: Vec<Duration>) -> Row {
    let (m, a, b) = stats(v);
    Row {
        case: case.into(),
        median_us: m,
        p10_us: a,
        p90_us: b,
        per_sec: 1e6 / m,
    }
}

/// A row of a rate: `n` operations in `d`.
pub fn rate(case: &str, n: u64, d: Duration) -> Row {
    let per = d.as_secs_f64() * 1e6 / n as f64;
    Row {
        case: case.into(),
        median_us: per,
        p10_us: per,
        p90_us: per,
        per_sec: n as f64 / d.as_secs_f64(),
    }
}

/// Reads one byte of every 4 KiB page (volatile, so it is not optimized away).
pub fn touch(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .step_by(4096)
        // SAFETY: a reference to a live byte.
        .map(|b| u64::from(unsafe { std::ptr::read_volatile(b) }))
        .fold(0, u64::wrapping_add)
}

/// A read-only shared mapping placed at a 2 MiB-aligned address, so that the kernel can map
/// the pool's 2 MiB pages with one page-table entry each. Linux 6.18 places file mappings of
/// 2 MiB or more at such a boundary by itself, FUSE files included; where it did not (an
/// older kernel, or a crowded address space), the mapping is placed by hand.
pub struct AlignedMap {
    ptr: std::ptr::NonNull<std::ffi::c_void>,
    len: usize,
}

/// Huge page size of the pools.
const HUGE: usize = 2 << 20;

/// Unmaps `len` bytes at `addr`, an address inside a mapping made here.
///
/// # Safety
///
/// `[addr, addr + len)` is mapped by this module and nothing refers to it any more.
unsafe fn unmap(addr: usize, len: usize) -> anyhow::Result<()> {
    let p = std::ptr::NonNull::new(addr as *mut std::ffi::c_void).context("null mapping")?;
    // SAFETY: the caller's contract.
    unsafe { nix::sys::mman::munmap(p, len) }.context("munmap")
}

impl AlignedMap {
    /// Maps `len` bytes of `f` read-only at a 2 MiB boundary.
    pub fn new(f: &std::fs::File, len: usize) -> anyhow::Result<AlignedMap> {
        use nix::sys::mman::{MapFlags, ProtFlags, mmap, mmap_anonymous};
        use std::num::NonZeroUsize;
        let nz = NonZeroUsize::new(len).context("an empty mapping")?;
        // SAFETY: a new read-only shared mapping of a file; nothing else refers to it.
        let p = unsafe { mmap(None, nz, ProtFlags::PROT_READ, MapFlags::MAP_SHARED, f, 0) }
            .context("mmap")?;
        if len < HUGE || (p.as_ptr() as usize).is_multiple_of(HUGE) {
            return Ok(AlignedMap { ptr: p, len });
        }
        // Misplaced: unmap it, reserve a span with room for a 2 MiB boundary (PROT_NONE), map
        // the file at that boundary inside it, and return the slack on both sides.
        // SAFETY: the mapping just made, not handed out.
        unsafe { unmap(p.as_ptr() as usize, len)? };
        let span = len + HUGE;
        // SAFETY: a new anonymous reservation; nothing else refers to it.
        let res = unsafe {
            mmap_anonymous(
                None,
                NonZeroUsize::new(span).expect("len > 0"),
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }
        .with_context(|| format!("reserving {span} bytes"))?;
        let base = res.as_ptr() as usize;
        let start = base.next_multiple_of(HUGE);
        // SAFETY: MAP_FIXED at `start`, inside the reservation made above (start + len <=
        // base + span), which nothing else uses.
        let mapped = unsafe {
            mmap(
                NonZeroUsize::new(start),
                nz,
                ProtFlags::PROT_READ,
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                f,
                0,
            )
        };
        let p = match mapped {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the reservation made above, unused.
                unsafe { unmap(base, span)? };
                return Err(e).context("mmap");
            }
        };
        if start > base {
            // SAFETY: the reservation's slack before the mapping.
            unsafe { unmap(base, start - base)? };
        }
        let end = start + len;
        if base + span > end {
            // SAFETY: the reservation's slack after the mapping.
            unsafe { unmap(end, base + span - end)? };
        }
        Ok(AlignedMap { ptr: p, len })
    }
}

impl std::ops::Deref for AlignedMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: a live read-only mapping of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr() as *const u8, self.len) }
    }
}

impl Drop for AlignedMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; `&self` borrows of it have ended.
        if let Err(e) = unsafe { unmap(self.ptr.as_ptr() as usize, self.len) } {
            // Only a bad address or length fails; the mapping leaks (the bench goes on).
            eprintln!("maructl bench: {e:#}");
        }
    }
}

/// Opens `path` and maps `len` bytes of it at a 2 MiB boundary (the length known, as an
/// engine knows its chunk size: no `fstat`), with every page touched; the file is closed.
pub fn map_aligned(path: &Path, len: usize) -> anyhow::Result<AlignedMap> {
    let f =
        std::fs::File::open(path).map_err(|e| anyhow::anyhow!("open {}: {e}", path.display()))?;
    let m = AlignedMap::new(&f, len)?;
    std::hint::black_box(touch(&m));
    Ok(m)
}

/// Opens, maps, touches every page, unmaps and closes `path`.
pub fn map_touch(path: &Path) -> anyhow::Result<u64> {
    let f = std::fs::File::open(path)?;
    // SAFETY: read-only mapping of an immutable file.
    let m = unsafe { memmap2::Mmap::map(&f)? };
    Ok(touch(&m))
}

/// Rows as a Markdown table under a heading.
pub fn fmt_table(title: &str, rows: &[Row]) -> String {
    let mut s = format!(
        "\n## {title}\n\n| case | median µs | p10 µs | p90 µs | per second |\n|---|---:|---:|---:|---:|\n"
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.0} |\n",
            r.case, r.median_us, r.p10_us, r.p90_us, r.per_sec
        ));
    }
    s
}

fn find<'a>(rows: &'a [Row], case: &str) -> &'a Row {
    rows.iter()
        .find(|r| r.case == case)
        .unwrap_or_else(|| panic!("no row {case}"))
}

/// A target line: measured vs target.
fn target(
    out: &mut String,
    what: &str,
    measured: f64,
    goal: f64,
    higher_is_better: bool,
    unit: &str,
) {
    let ok = if higher_is_better {
        measured >= goal
    } else {
        measured <= goal
    };
    out.push_str(&format!(
        "| {what} | {measured:.2}{unit} | {}{goal}{unit} | {} |\n",
        if higher_is_better { ">= " } else { "<= " },
        if ok { "met" } else { "NOT met" }
    ));
}

/// Echo peer for the ping-pong baseline: echoes 8-byte messages on stdin/stdout (a socket).
pub fn echo_main() -> anyhow::Result<()> {
    let mut buf = [0u8; 8];
    let mut inp = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    while inp.read_exact(&mut buf).is_ok() {
        out.write_all(&buf)?;
        out.flush()?;
    }
    Ok(())
}

/// TCP sender for the transfer baseline: prints its port, then sends `size` bytes per request byte.
pub fn tcp_serve_main(size: usize) -> anyhow::Result<()> {
    let l = std::net::TcpListener::bind("0.0.0.0:0")?;
    println!("{}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let data = vec![7u8; size];
    let mut req = [0u8; 1];
    while s.read_exact(&mut req).is_ok() {
        if req[0] == COOL {
            // The KV a peer sends was written long ago: evict it, then say so.
            evict_all(&data);
            s.write_all(&[COOL])?;
        } else {
            s.write_all(&data)?;
        }
    }
    Ok(())
}

struct Echo {
    child: std::process::Child,
    sock: std::os::unix::net::UnixStream,
}

impl Echo {
    fn start() -> anyhow::Result<Self> {
        let (a, b) = std::os::unix::net::UnixStream::pair()?;
        let b2: OwnedFd = b.try_clone()?.into();
        let child = Command::new(std::env::current_exe()?)
            .arg("__echo")
            .stdin(Stdio::from(OwnedFd::from(b)))
            .stdout(Stdio::from(b2))
            .spawn()?;
        Ok(Echo { child, sock: a })
    }

    fn round_trips(&mut self, n: u64) -> anyhow::Result<Duration> {
        let mut b = [1u8; 8];
        let t = Instant::now();
        for _ in 0..n {
            self.sock.write_all(&b)?;
            self.sock.read_exact(&mut b)?;
        }
        Ok(t.elapsed())
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        // Teardown: each fails only if the peer is gone already, which is the goal.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory under /tmp.
pub fn scratch() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix("maru-bench-")
        .tempdir_in("/tmp")?)
}

/// The memfs rows again for entries in files of their own (a handler that does not say in
/// which namespace it stores, so nothing is packed), side by side with the packed ones.
fn own_files(
    d: &PrivateDaemon,
    payload: &[u8],
    batches: u64,
    stores: u64,
) -> anyhow::Result<Vec<Row>> {
    let h = maru::Handler::connect(maru::Config {
        socket: d.socket.clone(),
        ..Default::default()
    })?;
    let keys: Vec<String> = (0..64).map(|i| format!("bench/own{i}")).collect();
    for k in &keys {
        h.put(k, payload)?;
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let s = Instant::now();
    for _ in 0..batches {
        h.trim();
        std::hint::black_box(h.batch_retrieve(&refs)?);
    }
    let first = rate(
        "batch_retrieve(64), keys (first time, memfs entries in files of their own)",
        batches * 64,
        s.elapsed(),
    );
    let s = Instant::now();
    for i in 0..stores {
        let mut a = h.alloc(payload.len() as u64)?;
        a.as_mut_slice().copy_from_slice(payload);
        h.store(&format!("bench/own-y{i}"), a)?;
    }
    let store = rate(
        "store 4 KiB (each waits; memfs entries in files of their own)",
        stores,
        s.elapsed(),
    );
    Ok(vec![first, store])
}

/// First-time `batch_retrieve(64)` of 4 KiB entries on a raw pool (`file:`, the stand-in
/// for a CXL device), on a daemon of its own: a key costs no mapping there (entries are
/// slices of one mapping of the pool), so the rate is the protocol's and the store's.
fn first_batches_raw(dir: &Path, payload: &[u8], batches: u64) -> anyhow::Result<Row> {
    let d = PrivateDaemon::start(dir, "raw", &["file:{dir}/raw.img,size=512M"], false)?;
    let h = d.handler("bench")?;
    h.mkdir("bench", 0o755)?;
    // 16 sets of 64 keys taken in turn, the handler's mappings dropped before each batch
    // (as for the memfs row), so every key is asked of marud.
    let keys: Vec<String> = (0..16 * 64).map(|i| format!("bench/r{i}")).collect();
    for k in &keys {
        h.put(k, payload)?;
    }
    let sets: Vec<Vec<&str>> = keys
        .chunks(64)
        .map(|c| c.iter().map(String::as_str).collect())
        .collect();
    let s = Instant::now();
    for b in 0..batches as usize {
        h.trim();
        std::hint::black_box(h.batch_retrieve(&sets[b % sets.len()])?);
    }
    Ok(rate(
        "batch_retrieve(64), keys (first time, raw pool)",
        batches * 64,
        s.elapsed(),
    ))
}

/// `maructl bench core`: the store engine and libmaru.
/// Calls through the connection's shared-memory lane (`h`, the default) and on the socket
/// alone (a second handler without a lane), in alternating blocks: a call marud answers at
/// once (`mkdir` of a namespace that exists) and a 4 KiB store that waits.
fn lane_against_socket(
    d: &PrivateDaemon,
    h: &maru::Handler,
    payload: &[u8],
) -> anyhow::Result<Vec<Row>> {
    let socket = maru::Handler::connect(maru::Config {
        lane: false,
        ..d.config("bench")
    })?;
    let (blocks, n) = (20u64, 500u64);
    let mut t = [Duration::ZERO; 4];
    let mut seq = 0u64;
    for _ in 0..blocks {
        for (i, c) in [h, &socket].into_iter().enumerate() {
            let s = Instant::now();
            for _ in 0..n {
                anyhow::ensure!(matches!(
                    c.mkdir("bench", 0o755),
                    Err(maru::Error::Exists(_))
                ));
            }
            t[i] += s.elapsed();
            let s = Instant::now();
            for _ in 0..n {
                seq += 1;
                let mut a = c.alloc(payload.len() as u64)?;
                a.as_mut_slice().copy_from_slice(payload);
                c.store(&format!("bench/l{seq}"), a)?;
            }
            t[2 + i] += s.elapsed();
        }
    }
    Ok([
        "a call marud answers at once (mkdir of a namespace that exists), lane",
        "a call marud answers at once, socket alone",
        "store 4 KiB (each waits), lane",
        "store 4 KiB (each waits), socket alone",
    ]
    .into_iter()
    .zip(t)
    .map(|(name, d)| rate(name, blocks * n, d))
    .collect())
}

pub fn core(rounds: usize, json: Option<&Path>) -> anyhow::Result<String> {
    let tmp = scratch()?;
    let d = PrivateDaemon::start(tmp.path(), "core", &["memfs:{dir}/pool,size=2G"], false)?;
    let direct = Tmpfs::mount(&tmp.path().join("direct"), 256 << 20)?;
    let h = d.handler("bench")?;
    h.mkdir("bench", 0o755)?;
    let small = 4096usize;
    let big = 16usize << 20;
    let payload_small = vec![0x5au8; small];
    let payload_big = vec![0xa5u8; big];
    h.put("bench/small", &payload_small)?;
    h.put("bench/big", &payload_big)?;
    std::fs::write(direct.dir.join("small"), &payload_small)?;
    std::fs::write(direct.dir.join("big"), &payload_big)?;
    let keys: Vec<String> = (0..64).map(|i| format!("bench/b{i}")).collect();
    for k in &keys {
        h.put(k, &payload_small)?;
    }
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut echo = Echo::start()?;

    // Per-operation timings, interleaved round by round so noise hits every case alike.
    let names = [
        "memcpy 4 KiB",
        "memcpy 16 MiB",
        "direct mmap+touch 4 KiB (tmpfs file)",
        "direct mmap+touch 16 MiB (tmpfs file)",
        "libmaru retrieve+touch 4 KiB (first time: open + map)",
        "libmaru retrieve+touch 16 MiB (first time: open + map)",
        "libmaru retrieve+touch 4 KiB (retrieved before)",
        "libmaru retrieve+touch 16 MiB (retrieved before)",
        "libmaru store 4 KiB (alloc+copy+store, waits)",
        "libmaru store 16 MiB (alloc+copy+store, waits)",
    ];
    let mut t: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    let mut dst_small = vec![0u8; small];
    let mut dst_big = vec![0u8; big];
    let mut seq = 0u64;
    for _ in 0..rounds {
        let s = Instant::now();
        dst_small.copy_from_slice(std::hint::black_box(&payload_small));
        t[0].push(s.elapsed());
        let s = Instant::now();
        dst_big.copy_from_slice(std::hint::black_box(&payload_big));
        t[1].push(s.elapsed());
        let s = Instant::now();
        std::hint::black_box(map_touch(&direct.dir.join("small"))?);
        t[2].push(s.elapsed());
        let s = Instant::now();
        std::hint::black_box(map_touch(&direct.dir.join("big"))?);
        t[3].push(s.elapsed());
        for (cold, hot, key) in [(4, 6, "bench/small"), (5, 7, "bench/big")] {
            h.trim();
            for i in [cold, hot] {
                let s = Instant::now();
                let m = h.retrieve(key)?.context("missing")?;
                std::hint::black_box(touch(&m));
                drop(m);
                t[i].push(s.elapsed());
            }
        }
        for (i, payload) in [(8, &payload_small), (9, &payload_big)] {
            seq += 1;
            let s = Instant::now();
            let mut a = h.alloc(payload.len() as u64)?;
            a.as_mut_slice().copy_from_slice(payload);
            h.store(&format!("bench/s{seq}"), a)?;
            t[i].push(s.elapsed());
            h.delete(&format!("bench/s{seq}"))?;
        }
    }
    let mut rows: Vec<Row> = names.iter().zip(t).map(|(n, v)| timed(n, v)).collect();

    // Rates.
    let n = 200_000u64;
    let s = Instant::now();
    for _ in 0..n {
        std::hint::black_box(h.exists("bench/small")?);
    }
    rows.push(rate("exists (sealed key)", n, s.elapsed()));
    let s = Instant::now();
    for _ in 0..n {
        std::hint::black_box(h.retrieve("bench/small")?);
    }
    rows.push(rate("retrieve (key retrieved before)", n, s.elapsed()));
    let n_store = 20_000u64;
    let s = Instant::now();
    for i in 0..n_store {
        let mut a = h.alloc(small as u64)?;
        a.as_mut_slice().copy_from_slice(&payload_small);
        h.store_async(&format!("bench/a{i}"), a)?;
    }
    let errs = h.flush()?;
    anyhow::ensure!(errs.is_empty(), "async stores failed: {errs:?}");
    rows.push(rate(
        "store 4 KiB (pipelined, flushed)",
        n_store,
        s.elapsed(),
    ));
    let n_sync = 5_000u64;
    let s = Instant::now();
    for i in 0..n_sync {
        let mut a = h.alloc(small as u64)?;
        a.as_mut_slice().copy_from_slice(&payload_small);
        h.store(&format!("bench/y{i}"), a)?;
    }
    rows.push(rate(
        "store 4 KiB (each waits for the daemon)",
        n_sync,
        s.elapsed(),
    ));
    let nb = 20_000u64;
    let s = Instant::now();
    for _ in 0..nb {
        std::hint::black_box(h.batch_exists(&key_refs)?);
    }
    rows.push(rate("batch_exists(64), keys", nb * 64, s.elapsed()));
    h.batch_retrieve(&key_refs)?;
    let s = Instant::now();
    for _ in 0..nb {
        std::hint::black_box(h.batch_retrieve(&key_refs)?);
    }
    rows.push(rate(
        "batch_retrieve(64), keys (retrieved before)",
        nb * 64,
        s.elapsed(),
    ));
    let s = Instant::now();
    for _ in 0..nb / 20 {
        h.trim();
        std::hint::black_box(h.batch_retrieve(&key_refs)?);
    }
    rows.push(rate(
        "batch_retrieve(64), keys (first time)",
        nb / 20 * 64,
        s.elapsed(),
    ));
    rows.extend(own_files(&d, &payload_small, nb / 20, n_sync)?);
    rows.push(first_batches_raw(tmp.path(), &payload_small, nb / 20)?);
    let s = Instant::now();
    let mut n_rt = 0;
    for _ in 0..2_000 {
        h.trim();
        std::hint::black_box(h.retrieve("bench/small")?);
        n_rt += 1;
    }
    rows.push(rate("retrieve (first time)", n_rt, s.elapsed()));
    rows.extend(lane_against_socket(&d, &h, &payload_small)?);
    let pp = 20_000u64;
    let d_pp = echo.round_trips(pp)?;
    rows.push(rate(
        "bare Unix-socket ping-pong between two processes",
        pp,
        d_pp,
    ));

    let mut out = String::from("# maructl bench core\n");
    out.push_str(&format!(
        "\n{rounds} interleaved rounds for the timed cases; rates from back-to-back loops. One client, this machine ({} CPUs).\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    ));
    out.push_str(&fmt_table("Timed operations", &rows[..10]));
    out.push_str(&fmt_table("Rates", &rows[10..]));
    out.push_str("\n## Targets (10x the original design's Python metadata server)\n\n| target | measured | goal | |\n|---|---:|---:|---|\n");
    target(
        &mut out,
        "exists/s",
        find(&rows, "exists (sealed key)").per_sec,
        100_000.0,
        true,
        "",
    );
    target(
        &mut out,
        "retrieve/s (retrieved before)",
        find(&rows, "retrieve (key retrieved before)").per_sec,
        100_000.0,
        true,
        "",
    );
    target(
        &mut out,
        "store 4 KiB/s",
        find(&rows, "store 4 KiB (pipelined, flushed)").per_sec,
        40_000.0,
        true,
        "",
    );
    target(
        &mut out,
        "batch_retrieve(64) keys/s",
        find(&rows, "batch_retrieve(64), keys (retrieved before)").per_sec,
        1_000_000.0,
        true,
        "",
    );
    // Issue 16's cold-path targets: a batch of keys this handler never retrieved.
    for (label, row, goal) in [
        (
            "first-time batch_retrieve(64) keys/s, memfs",
            "batch_retrieve(64), keys (first time)",
            200_000.0,
        ),
        (
            "first-time batch_retrieve(64) keys/s, raw pool",
            "batch_retrieve(64), keys (first time, raw pool)",
            500_000.0,
        ),
    ] {
        target(&mut out, label, find(&rows, row).per_sec, goal, true, "");
    }
    let direct16 = find(&rows, "direct mmap+touch 16 MiB (tmpfs file)").median_us;
    let cold16 = find(
        &rows,
        "libmaru retrieve+touch 16 MiB (first time: open + map)",
    )
    .median_us;
    let hot16 = find(&rows, "libmaru retrieve+touch 16 MiB (retrieved before)").median_us;
    target(
        &mut out,
        "retrieve 16 MiB first time / direct mmap",
        cold16 / direct16,
        1.5,
        false,
        "x",
    );
    target(
        &mut out,
        "retrieve 16 MiB retrieved before / direct mmap",
        hot16 / direct16,
        1.5,
        false,
        "x",
    );
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(&rows)?)?;
    }
    drop(h);
    Ok(out)
}

/// A TCP sender in a process of its own (`__tcp-serve`): the transfer baseline.
pub struct TcpPeer {
    child: std::process::Child,
    sock: std::net::TcpStream,
}

impl TcpPeer {
    /// A sender of `size` bytes per request on loopback.
    pub fn start(size: usize) -> anyhow::Result<Self> {
        Self::start_between(size, None, std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// A sender in network namespace `netns` (None: this one), reached at `addr` from the
    /// calling thread's namespace.
    pub fn start_between(
        size: usize,
        netns: Option<&Path>,
        addr: std::net::IpAddr,
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__tcp-serve")
            .arg(size.to_string())
            .stdout(Stdio::piped());
        let ns = netns.map(std::fs::File::open).transpose()?;
        if let Some(f) = &ns {
            use std::os::unix::process::CommandExt;
            let fd = f.as_raw_fd();
            // SAFETY: setns is async-signal-safe; the namespace's file outlives the spawn.
            unsafe {
                cmd.pre_exec(move || {
                    let ns = std::os::fd::BorrowedFd::borrow_raw(fd);
                    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
                    Ok(())
                });
            }
        }
        let child = cmd.spawn()?;
        drop(ns);
        Self::connect(child, addr)
    }

    fn connect(mut child: std::process::Child, addr: std::net::IpAddr) -> anyhow::Result<Self> {
        let mut line = String::new();
        let mut out = child.stdout.take().context("stdout")?;
        let mut b = [0u8; 1];
        while out.read(&mut b)? == 1 && b[0] != b'\n' {
            line.push(b[0] as char);
        }
        let port: u16 = line.trim().parse()?;
        let sock = std::net::TcpStream::connect((addr, port))?;
        sock.set_nodelay(true)?;
        Ok(TcpPeer { child, sock })
    }

    /// Has the peer evict the bytes it sends from the CPU caches (before a timed fetch).
    fn cool(&mut self) -> anyhow::Result<()> {
        let mut ack = [0u8; 1];
        self.sock.write_all(&[COOL])?;
        self.sock.read_exact(&mut ack)?;
        anyhow::ensure!(ack[0] == COOL, "TCP peer: unexpected answer {}", ack[0]);
        Ok(())
    }

    /// Receives `buf.len()` bytes from the sender.
    pub fn fetch(&mut self, buf: &mut [u8]) -> anyhow::Result<()> {
        self.sock.write_all(&[1])?;
        self.sock.read_exact(buf)?;
        Ok(())
    }
}

impl Drop for TcpPeer {
    fn drop(&mut self) {
        // Teardown: each fails only if the peer is gone already, which is the goal.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fisher-Yates with xorshift64: a reproducible order.
fn shuffle(v: &mut [usize], state: &mut u64) {
    for i in (1..v.len()).rev() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        v.swap(i, (*state % (i as u64 + 1)) as usize);
    }
}

/// Flushes from every CPU cache the lines [`touch`] reads of `m` (and their neighbours,
/// which the adjacent-line prefetcher brings along).
fn evict(m: &[u8]) {
    clflush(m, (0..m.len()).step_by(4096).flat_map(|p| [p, p + 64]));
}

/// Flushes every cache line of `m` from every CPU cache.
fn evict_all(m: &[u8]) {
    clflush(m, (0..m.len()).step_by(64));
}

/// Flushes the lines of `m` at `offsets` (those past its end are skipped) from every CPU
/// cache, then fences.
fn clflush(m: &[u8], offsets: impl Iterator<Item = usize>) {
    #[cfg(target_arch = "x86_64")]
    {
        for b in offsets.filter_map(|o| m.get(o)) {
            // SAFETY: clflush of an address inside a live buffer.
            unsafe { std::arch::x86_64::_mm_clflush(b) };
        }
        // SAFETY: a fence has no preconditions.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (m, offsets);
}

/// The TCP peer's request byte for [`evict_all`] of what it sends (any other byte: send).
const COOL: u8 = b'c';

/// The phases of one retrieval by mapping.
const PHASES: [&str; 5] = ["open", "mmap", "touch every page", "munmap", "close"];

/// Opens `path`, maps `len` bytes at a 2 MiB boundary, touches every page, unmaps and
/// closes, and returns the time of each of the [`PHASES`].
fn retrieve_phases(path: &Path, len: usize) -> anyhow::Result<[Duration; 5]> {
    let t0 = Instant::now();
    let f = std::fs::File::open(path)?;
    let t1 = Instant::now();
    let m = AlignedMap::new(&f, len)?;
    let t2 = Instant::now();
    std::hint::black_box(touch(&m));
    let t3 = Instant::now();
    drop(m);
    let t4 = Instant::now();
    drop(f);
    let t5 = Instant::now();
    Ok([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])
}

/// `maructl bench fs`: retrieval through the mount; `extra`: flags for the mount's marud.
pub fn fs(rounds: usize, json: Option<&Path>, extra: &[String]) -> anyhow::Result<String> {
    let tmp = scratch()?;
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let d = PrivateDaemon::start_with(
        tmp.path(),
        "fs",
        &["memfs:{dir}/pool,size=1G"],
        true,
        &extra,
    )?;
    let copy = PrivateDaemon::start(tmp.path(), "copy", &["file:{dir}/dev.img,size=512M"], true)
        .context("starting the copying daemon (file: pool)")?;
    let mnt = d.mount.clone().context("mount")?;
    let cmnt = copy.mount.clone().context("mount")?;
    std::fs::create_dir(mnt.join("bench"))?;
    std::fs::create_dir(cmnt.join("bench"))?;
    let sizes = [256usize << 10, 4 << 20, 16 << 20, 64 << 20];
    let label = |s: usize| {
        if s >= 1 << 20 {
            format!("{} MiB", s >> 20)
        } else {
            format!("{} KiB", s >> 10)
        }
    };
    let mut peers = Vec::new();
    for &s in &sizes {
        let data = vec![0x3cu8; s];
        std::fs::write(mnt.join(format!("bench/{s}")), &data)?;
        std::fs::write(cmnt.join(format!("bench/{s}")), &data)?;
        peers.push(TcpPeer::start(s)?);
    }
    let pool = d.pool_dirs[0].clone();
    let cases = [
        "/maru open+mmap+touch",
        "pool file mmap+touch (direct)",
        "read() via copying FUSE",
        "loopback TCP receive",
    ];
    let mut t: Vec<Vec<Vec<Duration>>> = vec![vec![Vec::new(); cases.len()]; sizes.len()];
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|s| vec![0u8; *s]).collect();
    // Phases of the two mapping cases, as timed inside the interleaved loop.
    let mut inline: Vec<Vec<Vec<Vec<Duration>>>> =
        vec![vec![vec![Vec::new(); PHASES.len()]; 2]; sizes.len()];
    // Every case starts from memory, as a consumer of KV written long ago does: the cache
    // lines a retrieval reads are evicted first (otherwise the case that runs right after
    // another one on the same entry finds them in the 32 MiB L3 and reads 2-3x faster).
    let evictors: Vec<AlignedMap> = sizes
        .iter()
        .map(|&s| {
            let f = std::fs::File::open(pool.join(format!("n/bench/{s}")))?;
            AlignedMap::new(&f, s)
        })
        .collect::<anyhow::Result<_>>()?;
    // What each case opens (the TCP case: nothing), made before the clock starts.
    let paths: Vec<[PathBuf; 4]> = sizes
        .iter()
        .map(|s| {
            [
                mnt.join(format!("bench/{s}")),
                pool.join(format!("n/bench/{s}")),
                cmnt.join(format!("bench/{s}")),
                PathBuf::new(),
            ]
        })
        .collect();
    let mut order: Vec<usize> = (0..cases.len()).collect();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    // The opens of the two mapping cases at 16 MiB, by what ran just before (the open is
    // the one step whose cost depends on it): a /maru retrieval, a direct mapping, or a
    // transfer that copies (read() via FUSE, TCP).
    let mut after: Vec<Vec<Vec<Duration>>> = vec![vec![Vec::new(); 3]; 2];
    let mut prev: Option<usize> = None;
    for _ in 0..rounds {
        for (i, &s) in sizes.iter().enumerate() {
            // A new order each round (fixed seed), so that no case always follows another.
            shuffle(&mut order, &mut rng);
            for &c in &order {
                evict(&evictors[i]);
                if c == 3 {
                    peers[i].cool()?;
                }
                let path = &paths[i][c];
                let st = Instant::now();
                let phases = match c {
                    0 | 1 => Some(retrieve_phases(path, s)?),
                    2 => {
                        std::fs::File::open(path)?.read_exact(&mut bufs[i])?;
                        None
                    }
                    _ => {
                        peers[i].fetch(&mut bufs[i])?;
                        None
                    }
                };
                t[i][c].push(st.elapsed());
                for (k, d) in phases.into_iter().flatten().enumerate() {
                    inline[i][c][k].push(d);
                }
                if c < 2
                    && s == 16 << 20
                    && let Some(p) = prev
                {
                    after[c][p.min(2)].push(inline[i][c][0].last().copied().unwrap_or_default());
                }
                prev = Some(c);
            }
        }
    }
    let mut rows = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        for (c, v) in cases.iter().zip(std::mem::take(&mut t[i])) {
            rows.push(timed(&format!("{} {}", c, label(s)), v));
        }
    }
    // Where the time of one retrieval goes, at 16 MiB: inside the interleaved loop, and
    // back to back (the same entry again and again, everything warm).
    let i16 = sizes.iter().position(|&s| s == 16 << 20).expect("16 MiB");
    for (c, label_) in [(0, "/maru"), (1, "direct")] {
        for (k, v) in std::mem::take(&mut inline[i16][c]).into_iter().enumerate() {
            rows.push(timed(
                &format!("phase {} 16 MiB {label_}, interleaved", PHASES[k]),
                v,
            ));
        }
    }
    for (c, label_) in [(0, "/maru"), (1, "direct")] {
        for (k, what) in [
            "a /maru retrieval",
            "a direct mapping",
            "a copying transfer (FUSE read or TCP)",
        ]
        .into_iter()
        .enumerate()
        {
            let v = std::mem::take(&mut after[c][k]);
            if v.is_empty() {
                continue;
            }
            rows.push(timed(
                &format!(
                    "phase open 16 MiB {label_}, interleaved, after {what} (n={})",
                    v.len()
                ),
                v,
            ));
        }
    }
    for (label_, path) in [
        ("/maru", mnt.join(format!("bench/{}", 16 << 20))),
        ("direct", pool.join(format!("n/bench/{}", 16 << 20))),
    ] {
        let mut ph: Vec<Vec<Duration>> = vec![Vec::new(); PHASES.len()];
        for _ in 0..rounds {
            evict(&evictors[i16]);
            for (k, d) in retrieve_phases(&path, 16 << 20)?.into_iter().enumerate() {
                ph[k].push(d);
            }
        }
        for (k, v) in ph.into_iter().enumerate() {
            rows.push(timed(
                &format!("phase {} 16 MiB {label_}, back to back", PHASES[k]),
                v,
            ));
        }
    }
    // Metadata: stat of a hot key, create+publish of 4 KiB entries.
    let hot = mnt.join(format!("bench/{}", sizes[0]));
    let n = 200_000u64;
    let st = Instant::now();
    for _ in 0..n {
        std::hint::black_box(std::fs::metadata(&hot)?);
    }
    rows.push(rate("stat of a hot key", n, st.elapsed()));
    let n_create = 3_000u64;
    let small = vec![1u8; 4096];
    let st = Instant::now();
    for i in 0..n_create {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(mnt.join(format!("bench/c{i}")))?;
        f.write_all(&small)?;
    }
    rows.push(rate(
        "create+write+close (publish) 4 KiB via /maru",
        n_create,
        st.elapsed(),
    ));
    // Stores of 16 MiB through the mount: with write(2) (each write goes through marud, which
    // sees whether it succeeded) and through a mapping (ftruncate reserves the pages; the
    // mapping is the pool's). Each entry is removed afterwards, untimed.
    let big = vec![0x3cu8; 16 << 20];
    let (mut by_write, mut by_map) = (Vec::new(), Vec::new());
    for i in 0..20 {
        let p = mnt.join(format!("bench/w{i}"));
        let t = Instant::now();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)?;
        f.write_all(&big)?;
        drop(f);
        by_write.push(t.elapsed());
        std::fs::remove_file(&p)?;
        let p = mnt.join(format!("bench/m{i}"));
        let t = Instant::now();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p)?;
        f.set_len(big.len() as u64)?;
        // SAFETY: a shared mapping of a file only this loop uses, dropped before its close.
        let mut m = unsafe { memmap2::MmapMut::map_mut(&f)? };
        m.copy_from_slice(&big);
        drop(m);
        drop(f);
        by_map.push(t.elapsed());
        std::fs::remove_file(&p)?;
    }
    rows.push(timed(
        "store 16 MiB via /maru: create+write+close",
        by_write,
    ));
    rows.push(timed(
        "store 16 MiB via /maru: create+ftruncate+mmap+copy+close",
        by_map,
    ));
    let opens = 20_000u64;
    let st = Instant::now();
    for _ in 0..opens {
        let f = std::fs::File::open(&hot)?;
        std::hint::black_box(f.as_raw_fd());
    }
    rows.push(rate(
        "open+close of a hot key (read-only)",
        opens,
        st.elapsed(),
    ));
    // The same open after the caller computed for a while without touching the kernel (a
    // spin): how much of a system call's cost is the state of the caches, which the VM's
    // neighbours evict while this one runs in user space. Then after work that streams 16
    // MiB: a copy in user space, and a loopback TCP receive (the kernel's network path,
    // another process on the other CPU), which leaves the next system call far colder.
    enum Before {
        Spin(u64),
        Memcpy,
        Tcp,
    }
    let src16 = vec![0x5au8; 16 << 20];
    for before in [
        Before::Spin(0),
        Before::Spin(1),
        Before::Spin(10),
        Before::Memcpy,
        Before::Tcp,
    ] {
        let what = match before {
            Before::Spin(ms) => format!("a {ms} ms spin"),
            Before::Memcpy => "a 16 MiB memcpy".into(),
            Before::Tcp => "a 16 MiB loopback TCP receive".into(),
        };
        for (label_, path) in [
            ("/maru", hot.clone()),
            ("direct", pool.join(format!("n/bench/{}", sizes[0]))),
        ] {
            let mut v = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                match before {
                    Before::Spin(ms) => {
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_millis(ms) {
                            std::hint::spin_loop();
                        }
                    }
                    Before::Memcpy => bufs[i16].copy_from_slice(&src16),
                    Before::Tcp => peers[i16].fetch(&mut bufs[i16])?,
                }
                std::hint::black_box(&bufs[i16]);
                let st = Instant::now();
                let f = std::fs::File::open(&path)?;
                v.push(st.elapsed());
                drop(f);
            }
            rows.push(timed(
                &format!("open of a hot key after {what}, {label_}"),
                v,
            ));
        }
    }

    let mut out = String::from("# maructl bench fs\n");
    if !extra.is_empty() {
        out.push_str(&format!(
            "\nmarud of the mount started with `{}`.\n",
            extra.join(" ")
        ));
    }
    out.push_str(&format!(
        "\n{rounds} interleaved rounds (the cases in a new order each round); every page (4 KiB) of each mapping touched, its cache lines evicted before each case (every retrieval reads from memory). Entries are mapped as an engine that knows its chunk size does: the length given (no `fstat`, which after a passthrough mmap costs a GETATTR round trip), with a plain `mmap` (Linux 6.18 places mappings of 2 MiB or more at a 2 MiB boundary, FUSE files included, so the pool's 2 MiB pages are mapped whole; the bench checks and places the mapping itself where the kernel did not). The *after* rows split the interleaved opens by the case that ran just before.\n"
    ));
    out.push_str(&fmt_table(
        "Retrieve one entry",
        &rows[..sizes.len() * cases.len()],
    ));
    out.push_str(&fmt_table(
        "Phases and metadata",
        &rows[sizes.len() * cases.len()..],
    ));
    out.push_str("\n## Ratios\n\n| size | /maru ÷ direct | TCP ÷ /maru | copy-FUSE ÷ /maru |\n|---|---:|---:|---:|\n");
    for &s in &sizes {
        let l = label(s);
        let m = find(&rows, &format!("{} {l}", cases[0])).median_us;
        let dd = find(&rows, &format!("{} {l}", cases[1])).median_us;
        let c = find(&rows, &format!("{} {l}", cases[2])).median_us;
        let tcp = find(&rows, &format!("{} {l}", cases[3])).median_us;
        out.push_str(&format!(
            "| {l} | {:.2} | {:.1} | {:.1} |\n",
            m / dd,
            tcp / m,
            c / m
        ));
    }
    out.push_str("\n## Targets\n\n| target | measured | goal | |\n|---|---:|---:|---|\n");
    for s in [16usize << 20, 64 << 20] {
        let l = label(s);
        let m = find(&rows, &format!("{} {l}", cases[0])).median_us;
        let dd = find(&rows, &format!("{} {l}", cases[1])).median_us;
        target(
            &mut out,
            &format!("/maru ÷ direct at {l}"),
            m / dd,
            1.6,
            false,
            "x",
        );
    }
    let l = label(16 << 20);
    let m = find(&rows, &format!("{} {l}", cases[0])).median_us;
    let tcp = find(&rows, &format!("{} {l}", cases[3])).median_us;
    target(&mut out, "TCP ÷ /maru at 16 MiB", tcp / m, 30.0, true, "x");
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(&rows)?)?;
    }
    let _ = sibling("marud")?;
    Ok(out)
}
