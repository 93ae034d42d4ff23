//! The systems compared, and the consumer process that retrieves KV from one of them.
//!
//! A consumer is this binary re-executed with `__consume SPEC`: it prepares what a real
//! consumer would have ready before it needs the KV (a connection, a preallocated and
//! faulted-in receive buffer), prints `ready`, waits for one byte on stdin, then retrieves
//! every chunk, touching every page ("addressable"), and then reads every byte once ("read
//! once", what a copy to the GPU does). It prints its times and the checksum as JSON.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::data;
use maru_tools::bench::AlignedMap;

/// A system that hands KV from a producer to a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    /// maru through the mount: open + mmap of `/maru/<ns>/<key>`.
    MaruFs,
    /// maru through libmaru: one `batch_retrieve` round trip, then the mappings.
    Libmaru,
    /// The mapping limit: mmap of the pool's own file, no maru in the path.
    Direct,
    /// The copy limit: `read()` of the pool's tmpfs file into a preallocated buffer.
    Copy,
    /// A loopback TCP transfer from the producer into a preallocated buffer (P2P over TCP).
    Tcp,
    /// Redis GET on loopback (LMCache's Redis remote backend).
    Redis,
}

impl System {
    /// Every system, in report order.
    pub const ALL: [System; 6] = [
        System::MaruFs,
        System::Libmaru,
        System::Direct,
        System::Copy,
        System::Tcp,
        System::Redis,
    ];

    /// Name in tables and legends.
    pub fn label(self) -> &'static str {
        match self {
            System::MaruFs => "maru /maru (open+mmap)",
            System::Libmaru => "maru libmaru",
            System::Direct => "pool file mmap (limit)",
            System::Copy => "tmpfs read() (copy limit)",
            System::Tcp => "loopback TCP",
            System::Redis => "Redis",
        }
    }

    /// Short name (JSON keys).
    pub fn key(self) -> &'static str {
        match self {
            System::MaruFs => "maru-fs",
            System::Libmaru => "libmaru",
            System::Direct => "direct",
            System::Copy => "copy",
            System::Tcp => "tcp",
            System::Redis => "redis",
        }
    }
}

/// What a consumer retrieves and from where.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    /// The system.
    pub system: System,
    /// Number of chunks.
    pub chunks: usize,
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// Namespace (directory under the mount, key prefix elsewhere).
    pub ns: String,
    /// The maru mount.
    pub mount: PathBuf,
    /// The memfs pool's directory (its `n/` tree holds the entries' files).
    pub pool: PathBuf,
    /// The daemon's control socket.
    pub socket: PathBuf,
    /// The TCP producer's port.
    pub tcp_port: u16,
    /// Redis's port.
    pub redis_port: u16,
    /// Whether to read every byte once after the KV is addressable.
    pub read_pass: bool,
}

impl Spec {
    /// Key of chunk `i` in maru (namespace/key).
    pub fn maru_key(&self, i: usize) -> String {
        format!("{}/c{i}", self.ns)
    }

    /// Key of chunk `i` in Redis.
    pub fn redis_key(&self, i: usize) -> String {
        format!("{}:c{i}", self.ns)
    }
}

/// What a consumer measured. Times are CLOCK_MONOTONIC nanoseconds, comparable across
/// processes on this machine; CPU times are the consumer's own user + system time.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Outcome {
    /// When it got the go signal.
    pub go_ns: u64,
    /// When every chunk was addressable with every page touched.
    pub addr_ns: u64,
    /// When every byte had been read once (equal to `addr_ns` without a read pass).
    pub read_ns: u64,
    /// CPU time until addressable, microseconds.
    pub cpu_addr_us: u64,
    /// CPU time until read once, microseconds.
    pub cpu_read_us: u64,
    /// Checksum of the bytes (0 without a read pass).
    pub sum: u64,
}

/// CLOCK_MONOTONIC now, in nanoseconds.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// This process's user + system CPU time, microseconds.
pub fn cpu_us() -> u64 {
    // SAFETY: zeroed rusage is a valid out value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

/// A zeroed buffer with every page faulted in (a receive buffer an engine keeps ready).
pub fn ready_buffer(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for b in v.iter_mut().step_by(4096) {
        // SAFETY: writing a live byte; volatile so the fault is not optimized away.
        unsafe { std::ptr::write_volatile(b, 1) };
    }
    v
}

/// Received KV, owned in whatever form the system hands it over.
enum Held {
    Maps(Vec<AlignedMap>),
    Lib(Vec<maru::Mapping>),
    Buf(Vec<u8>),
    Vecs(Vec<Vec<u8>>),
}

impl Held {
    fn slices(&self) -> Vec<&[u8]> {
        match self {
            Held::Maps(v) => v.iter().map(|m| &m[..]).collect(),
            Held::Lib(v) => v.iter().map(|m| m.as_slice()).collect(),
            Held::Buf(b) => vec![&b[..]],
            Held::Vecs(v) => v.iter().map(|b| &b[..]).collect(),
        }
    }
}

/// Sends one request per chunk (4-byte little-endian index), then receives them in order.
pub fn tcp_receive(
    s: &mut std::net::TcpStream,
    buf: &mut [u8],
    chunk: usize,
) -> anyhow::Result<()> {
    let n = buf.len() / chunk;
    let req: Vec<u8> = (0..n as u32).flat_map(u32::to_le_bytes).collect();
    s.write_all(&req)?;
    for c in buf.chunks_exact_mut(chunk) {
        s.read_exact(c)?;
    }
    Ok(())
}

/// The consumer role (`__consume SPEC`).
pub fn consume_main(spec_json: &str) -> anyhow::Result<()> {
    let spec: Spec = serde_json::from_str(spec_json)?;
    let total = spec.chunks * spec.chunk_bytes;
    // Preparation, outside the timed part.
    let mut tcp = None;
    let mut redis_con = None;
    let mut lib = None;
    let mut buf = Vec::new();
    match spec.system {
        System::Tcp => {
            let s = std::net::TcpStream::connect(("127.0.0.1", spec.tcp_port))?;
            s.set_nodelay(true)?;
            tcp = Some(s);
            buf = ready_buffer(total);
        }
        System::Copy => buf = ready_buffer(total),
        System::Redis => {
            let c = redis::Client::open(format!("redis://127.0.0.1:{}/", spec.redis_port))?;
            redis_con = Some(c.get_connection()?);
        }
        System::Libmaru => {
            lib = Some(maru::Handler::connect(maru::Config {
                socket: spec.socket.clone(),
                client_name: "bench-consumer".into(),
                ..Default::default()
            })?);
        }
        System::MaruFs | System::Direct => {}
    }
    let keys: Vec<String> = (0..spec.chunks).map(|i| spec.maru_key(i)).collect();
    println!("ready");
    std::io::stdout().flush()?;
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go)?;

    let go_ns = now_ns();
    let cpu0 = cpu_us();
    let held = match spec.system {
        System::MaruFs => Held::Maps(
            keys.iter()
                .map(|k| maru_tools::bench::map_aligned(&spec.mount.join(k), spec.chunk_bytes))
                .collect::<anyhow::Result<_>>()?,
        ),
        System::Direct => Held::Maps(
            keys.iter()
                .map(|k| {
                    maru_tools::bench::map_aligned(&spec.pool.join("n").join(k), spec.chunk_bytes)
                })
                .collect::<anyhow::Result<_>>()?,
        ),
        System::Libmaru => {
            let h = lib.as_ref().context("handler")?;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let maps = h
                .batch_retrieve(&refs)?
                .into_iter()
                .zip(&keys)
                .map(|(m, k)| m.with_context(|| format!("{k} missing")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for m in &maps {
                std::hint::black_box(maru_tools::bench::touch(m));
            }
            Held::Lib(maps)
        }
        System::Copy => {
            for (k, dst) in keys.iter().zip(buf.chunks_exact_mut(spec.chunk_bytes)) {
                let mut f = std::fs::File::open(spec.pool.join("n").join(k))?;
                f.read_exact(dst)?;
            }
            Held::Buf(std::mem::take(&mut buf))
        }
        System::Tcp => {
            tcp_receive(tcp.as_mut().context("tcp")?, &mut buf, spec.chunk_bytes)?;
            Held::Buf(std::mem::take(&mut buf))
        }
        System::Redis => {
            let con = redis_con.as_mut().context("redis")?;
            let mut v = Vec::with_capacity(spec.chunks);
            for i in 0..spec.chunks {
                let b: Vec<u8> = redis::cmd("GET").arg(spec.redis_key(i)).query(con)?;
                anyhow::ensure!(
                    b.len() == spec.chunk_bytes,
                    "redis chunk {i}: {} bytes",
                    b.len()
                );
                v.push(b);
            }
            Held::Vecs(v)
        }
    };
    let addr_ns = now_ns();
    let cpu1 = cpu_us();
    let (sum, read_ns, cpu2) = if spec.read_pass {
        let s = held
            .slices()
            .iter()
            .fold(0u64, |a, b| a.wrapping_add(data::sum(b)));
        (s, now_ns(), cpu_us())
    } else {
        (0, addr_ns, cpu1)
    };
    let out = Outcome {
        go_ns,
        addr_ns,
        read_ns,
        cpu_addr_us: cpu1 - cpu0,
        cpu_read_us: cpu2 - cpu0,
        sum,
    };
    drop(held);
    println!("{}", serde_json::to_string(&out)?);
    std::io::stdout().flush()?;
    // Keep the connection until the harness has read the servers' CPU time.
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop((tcp, redis_con, lib));
    Ok(())
}

/// A consumer process, started and waiting for its go signal.
pub struct Consumer {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Consumer {
    /// Starts a consumer and waits until it is ready.
    pub fn start(spec: &Spec) -> anyhow::Result<Self> {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .arg("__consume")
            .arg(serde_json::to_string(spec)?)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = std::io::BufReader::new(child.stdout.take().context("stdout")?);
        let mut c = Consumer {
            child,
            stdin: Some(stdin),
            stdout,
        };
        let mut line = String::new();
        c.stdout.read_line(&mut line)?;
        anyhow::ensure!(
            line.trim() == "ready",
            "{} consumer did not start: {line:?}",
            spec.system.key()
        );
        Ok(c)
    }

    /// Sends the go signal.
    pub fn go(&mut self) -> anyhow::Result<()> {
        let s = self.stdin.as_mut().context("ended")?;
        s.write_all(b"g")?;
        s.flush()?;
        Ok(())
    }

    /// Waits for the outcome; the consumer then waits for [`Consumer::end`].
    pub fn outcome(&mut self) -> anyhow::Result<Outcome> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        serde_json::from_str(line.trim()).with_context(|| format!("consumer outcome {line:?}"))
    }

    /// Lets the consumer exit and waits for it.
    pub fn end(mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        let st = self.child.wait()?;
        anyhow::ensure!(st.success(), "consumer failed ({st})");
        Ok(())
    }

    /// [`Consumer::outcome`] then [`Consumer::end`].
    pub fn finish(mut self) -> anyhow::Result<Outcome> {
        let o = self.outcome()?;
        self.end()?;
        Ok(o)
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
