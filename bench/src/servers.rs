//! The peers a consumer retrieves from: a TCP producer holding the KV in memory, and a
//! private Redis server. Both are processes of ours, killed by pid on drop.

use std::io::{BufRead, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::data;

/// Run time of every thread of process `pid` so far, nanoseconds (from schedstat).
pub fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    rd.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn kill_child(c: &mut Child) {
    maru_tools::env::stop_child(c, Duration::from_secs(5));
}

/// The TCP producer role (`__tcp-kv CHUNKS CHUNK_BYTES`): it computes the chunks (the same
/// bytes every system holds), prints its port, and serves every connection on a thread of
/// its own: for each 4-byte chunk index received, it sends that chunk.
pub fn tcp_kv_main(chunks: usize, chunk_bytes: usize) -> anyhow::Result<()> {
    let data: Vec<Vec<u8>> = (0..chunks)
        .map(|i| {
            let mut b = vec![0u8; chunk_bytes];
            data::fill(i as u64, &mut b);
            b
        })
        .collect();
    let data = std::sync::Arc::new(data);
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    println!("{}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    for s in l.incoming() {
        let mut s = s?;
        let data = data.clone();
        std::thread::spawn(move || {
            let _ = s.set_nodelay(true);
            let mut req = [0u8; 4];
            while s.read_exact(&mut req).is_ok() {
                let i = u32::from_le_bytes(req) as usize;
                let Some(c) = data.get(i) else { return };
                if s.write_all(c).is_err() {
                    return;
                }
            }
        });
    }
    Ok(())
}

/// A TCP producer process.
pub struct TcpProducer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl TcpProducer {
    /// Starts a producer of `chunks` chunks and waits until it listens.
    pub fn start(chunks: usize, chunk_bytes: usize) -> anyhow::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("__tcp-kv")
            .arg(chunks.to_string())
            .arg(chunk_bytes.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
        let port = match line.trim().parse() {
            Ok(p) => p,
            Err(_) => {
                kill_child(&mut child);
                bail!("the TCP producer did not start: {line:?}");
            }
        };
        Ok(TcpProducer { child, port })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for TcpProducer {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

/// A private redis-server on loopback, without persistence.
pub struct Redis {
    child: Child,
    /// Its port.
    pub port: u16,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Redis {
    /// Starts redis-server in `dir`; `maxmemory` (bytes) with `allkeys-lru` when given.
    pub fn start(dir: &Path, maxmemory: Option<u64>) -> anyhow::Result<Self> {
        let exe = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .context("redis-server not found (apt-get install redis-server)")?;
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
        let mut cmd = Command::new(exe);
        cmd.arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(dir)
            .args(["--logfile", "redis.log"]);
        if let Some(m) = maxmemory {
            cmd.arg("--maxmemory")
                .arg(m.to_string())
                .args(["--maxmemory-policy", "allkeys-lru"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        let mut r = Redis { child, port };
        let t = Instant::now();
        loop {
            if let Ok(mut c) = r.connect()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return Ok(r);
            }
            if let Ok(Some(st)) = r.child.try_wait() {
                bail!(
                    "redis-server exited ({st}): {}",
                    std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default()
                );
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!("redis-server did not answer");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A new connection.
    pub fn connect(&self) -> anyhow::Result<redis::Connection> {
        Ok(redis::Client::open(format!("redis://127.0.0.1:{}/", self.port))?.get_connection()?)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}
