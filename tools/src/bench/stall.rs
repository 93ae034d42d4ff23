//! `maructl bench stall`: how long a client's small stores wait while another client makes a
//! large allocation on the same memfs pool (a file of its own, `fallocate`d), side by side
//! with the same loop alone and with the same `fallocate` made outside maru (on a tmpfs of
//! its own, by this process): what that costs the machine without any lock of maru's. The
//! large work runs again and again through its window, so that each window has thousands of
//! stores; a last window times bare round trips between two threads, the machine's own floor.
//!
//! With `--through-mount`, the large work is instead a process writing an entry through the
//! mount into a raw pool (a `file:` pool on a tmpfs) and closing it, which copies its bytes
//! into the pool, and then deleting it; beside it, the same bytes written to a file of a tmpfs
//! without maru.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::scratch;
use crate::env::{PrivateDaemon, Tmpfs, sibling};

/// The small stores of one window, and the large allocations that ran during it.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    pub case: String,
    pub stores: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// The large allocations' times (empty for the window alone).
    pub big_alloc_s: Vec<f64>,
}

fn window(case: &str, mut v: Vec<Duration>, big: Vec<f64>) -> Window {
    v.sort();
    let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize].as_secs_f64() * 1e6;
    Window {
        case: case.into(),
        stores: v.len(),
        p50_us: q(0.5),
        p99_us: q(0.99),
        max_us: q(1.0),
        big_alloc_s: big,
    }
}

/// How long each window lasts, in each round.
const WINDOW: Duration = Duration::from_secs(1);

/// Stores in a loop (with `store`) while `work` runs on another thread, then `after` (which
/// undoes it), again and again for `WINDOW`: each work's seconds.
fn during(
    store: &mut impl FnMut(&mut Vec<Duration>) -> anyhow::Result<()>,
    out: &mut Vec<Duration>,
    work: impl Fn() -> anyhow::Result<()> + Sync,
    after: impl Fn() -> anyhow::Result<()> + Sync,
) -> anyhow::Result<Vec<f64>> {
    let t = Instant::now();
    let mut took = Vec::new();
    while took.is_empty() || t.elapsed() < WINDOW {
        let done = AtomicBool::new(false);
        took.push(std::thread::scope(|s| -> anyhow::Result<f64> {
            let worker = s.spawn(|| -> anyhow::Result<f64> {
                let t = Instant::now();
                let r = work();
                let took = t.elapsed().as_secs_f64();
                done.store(true, Ordering::Release);
                r?;
                after()?;
                Ok(took)
            });
            while !done.load(Ordering::Acquire) && !worker.is_finished() {
                store(out)?;
            }
            worker.join().expect("the working thread panicked")
        })?);
    }
    Ok(took)
}

/// Round trips of 64 bytes over a socket pair between this thread and another of this
/// process, for `WINDOW`: what the machine itself makes a round trip wait (no maru, no large
/// work), the floor under the stores' figures.
fn bare_round_trips(out: &mut Vec<Duration>) -> anyhow::Result<()> {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let (mut near, mut far) = UnixStream::pair()?;
    std::thread::scope(|s| -> anyhow::Result<()> {
        s.spawn(move || {
            let mut b = [0u8; 64];
            while far.read_exact(&mut b).is_ok() && far.write_all(&b).is_ok() {}
        });
        let mut b = [0u8; 64];
        let t = Instant::now();
        while t.elapsed() < WINDOW {
            let one = Instant::now();
            near.write_all(&b)?;
            near.read_exact(&mut b)?;
            out.push(one.elapsed());
        }
        near.shutdown(std::net::Shutdown::Both)?;
        Ok(())
    })
}

/// Writes `big` bytes to a new file at `path` in 1 MiB writes and closes it.
fn write_file(path: &Path, big: u64) -> anyhow::Result<()> {
    let chunk = vec![0xa5u8; 1 << 20];
    let mut f = std::fs::File::create(path)?;
    let mut left = big;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    drop(f); // close(2): through the mount, the entry's commit (its copy into a raw pool)
    Ok(())
}

/// What `maructl bench stall` runs.
#[derive(Debug, Clone)]
pub struct StallArgs {
    /// The large work's bytes.
    pub big: u64,
    /// Alternated rounds.
    pub rounds: usize,
    /// The large work is an entry written through the mount into a raw pool, not a client's
    /// allocation on a memfs pool.
    pub through_mount: bool,
    /// The marud to measure (None: the one beside maructl).
    pub marud: Option<std::path::PathBuf>,
}

/// `rounds` rounds, each a window (`WINDOW`) of 4 KiB stores alone, one while another client
/// allocates (and frees) `big` bytes again and again (or writes as much through the mount),
/// one while this process does the same work on a tmpfs of its own, and one of bare round
/// trips between two threads (the machine's floor), alternated so that noise hits them alike.
pub fn stall(args: &StallArgs, json: Option<&Path>) -> anyhow::Result<String> {
    let StallArgs {
        big,
        rounds,
        through_mount,
        ..
    } = *args;
    let tmp = scratch()?;
    let pool = big + (1 << 30);
    let raw = if through_mount {
        Some(Tmpfs::mount(&tmp.path().join("raw"), pool + (64 << 20))?)
    } else {
        None
    };
    let spec = match &raw {
        Some(t) => format!("file:{}/pool.img,size={pool}", t.dir.display()),
        None => format!("memfs:{{dir}}/pool,size={pool}"),
    };
    let marud = match &args.marud {
        Some(p) => p.clone(),
        None => sibling("marud")?,
    };
    let d = PrivateDaemon::start_exe(&marud, tmp.path(), "stall", &[&spec], through_mount, &[])?;
    let small = d.handler("bench")?;
    small.mkdir("bench", 0o755)?;
    let other = d.handler("bench")?;
    let value = vec![0x5au8; 4096];
    let mut seq = 0u64;
    let mut store = |out: &mut Vec<Duration>| -> anyhow::Result<()> {
        let t = Instant::now();
        small.put(&format!("bench/s{seq}"), &value)?;
        out.push(t.elapsed());
        seq += 1;
        Ok(())
    };
    for _ in 0..200 {
        store(&mut Vec::new())?; // warm: the pack, the lane
    }
    let outside = Tmpfs::mount(&tmp.path().join("outside"), big + (1 << 30))?;
    let (mut alone, mut loaded, mut beside, mut floor) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut bigs, mut plain) = (Vec::<f64>::new(), Vec::<f64>::new());
    for _ in 0..rounds {
        let t = Instant::now();
        while t.elapsed() < WINDOW {
            store(&mut alone)?;
        }
        // Loaded: the other client allocates `big` bytes, then frees them (or writes them
        // through the mount, closes, and deletes the entry), again and again.
        let took = match &d.mount {
            Some(mnt) => {
                let entry = mnt.join("bench").join("big");
                during(
                    &mut store,
                    &mut loaded,
                    || write_file(&entry, big),
                    || Ok(std::fs::remove_file(&entry)?),
                )?
            }
            None => {
                let handle = std::sync::Mutex::new(None);
                during(
                    &mut store,
                    &mut loaded,
                    || {
                        *handle.lock().expect("one at a time") = Some(other.alloc(big)?);
                        Ok(())
                    },
                    || {
                        let a = handle.lock().expect("one at a time").take();
                        Ok(other.free(a.expect("allocated"))?)
                    },
                )?
            }
        };
        bigs.extend(took);
        // The same work without maru: a file of a tmpfs of this process's own.
        let path = outside.dir.join("big");
        let took = during(
            &mut store,
            &mut beside,
            || {
                if through_mount {
                    return write_file(&path, big);
                }
                let f = std::fs::File::create(&path)?;
                Ok(nix::fcntl::fallocate(
                    &f,
                    nix::fcntl::FallocateFlags::empty(),
                    0,
                    big as i64,
                )?)
            },
            || Ok(std::fs::remove_file(&path)?),
        )?;
        plain.extend(took);
        bare_round_trips(&mut floor)?;
    }
    let size = maru::size::format_size(big);
    let (work, plain_work, pool_kind) = if through_mount {
        (
            format!("another process writes {size} through the mount and closes"),
            format!("this process writes {size} to a file of a tmpfs (no maru)"),
            "raw pool",
        )
    } else {
        (
            format!("another client allocates {size}"),
            format!("this process fallocates {size} on a tmpfs (no maru)"),
            "memfs pool",
        )
    };
    let rows = [
        window("4 KiB stores alone", alone, Vec::new()),
        window(&format!("4 KiB stores while {work}"), loaded, bigs),
        window(&format!("4 KiB stores while {plain_work}"), beside, plain),
        window(
            "a bare round trip between two threads (no maru, no large work): the machine's floor",
            floor,
            Vec::new(),
        ),
    ];
    let mut out = format!(
        "\n## small stores while {work} ({pool_kind}, {rounds} rounds, {})\n\n\
         | case | stores | p50 µs | p99 µs | longest µs |\n|---|---:|---:|---:|---:|\n",
        marud.display()
    );
    for r in &rows {
        out.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} |\n",
            r.case, r.stores, r.p50_us, r.p99_us, r.max_us
        ));
    }
    let b = &rows[1].big_alloc_s;
    let mut took: Vec<f64> = b.clone();
    took.sort_by(f64::total_cmp);
    out.push_str(&format!(
        "\nthe large work ran {} times, {:.3}-{:.3} s (median {:.3} s); p99 loaded / alone: \
         {:.2}x; longest loaded: {:.2} ms (target: within 2x, at most 2 ms); the machine's \
         floor, a bare round trip's longest: {:.2} ms\n",
        took.len(),
        took.first().copied().unwrap_or_default(),
        took.last().copied().unwrap_or_default(),
        took.get(took.len() / 2).copied().unwrap_or_default(),
        rows[1].p99_us / rows[0].p99_us,
        rows[1].max_us / 1e3,
        rows[3].max_us / 1e3
    ));
    drop(outside);
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(&rows)?)?;
    }
    Ok(out)
}
