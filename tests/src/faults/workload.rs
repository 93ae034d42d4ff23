//! The clients: each a thread on one host, with a PRNG of its own seeded from the run's seed,
//! storing, retrieving, deleting, pinning and listing keys of one namespace, and recording
//! every operation in the history.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::env::connect;
use super::history::{History, Kind, Op, Outcome, entry, fnv, parse};

pub const NS: &str = "ns";

pub fn key(i: u64) -> String {
    format!("{NS}/k{i}")
}

/// One client's part of the workload.
pub struct Client {
    pub id: u32,
    pub host: usize,
    pub socket: PathBuf,
    pub keys: u64,
    pub seed: u64,
}

impl Client {
    /// Runs until `stop`; every operation goes to `history`.
    pub fn run(self, history: Arc<History>, stop: Arc<AtomicBool>) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ (u64::from(self.id) << 40));
        let mut handler: Option<maru::Handler> = None;
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let Some(h) = handler.as_ref() else {
                handler = connect(&self.socket, Duration::from_millis(500));
                continue;
            };
            let key = key(rng.gen_range(0..self.keys));
            let roll = rng.gen_range(0..100u32);
            let kind = match roll {
                0..35 => Kind::Store,
                35..70 => Kind::Retrieve,
                70..82 => Kind::Delete,
                82..88 => Kind::Pin,
                88..92 => Kind::Unpin,
                _ => Kind::List,
            };
            n += 1;
            let version = (u64::from(self.id) << 32) | n;
            let len = rng.gen_range(64..=(256 << 10));
            let start = history.now();
            let outcome = match kind {
                Kind::Store => outcome(store(h, &key, &entry(&key, version, len))),
                Kind::Retrieve => read(h, &key),
                Kind::Delete => outcome(h.delete(&key)),
                Kind::Pin => outcome(h.pin(&key)),
                Kind::Unpin => outcome(h.unpin(&key)),
                Kind::List => outcome(h.list(NS).map(|_| ())),
            };
            let end = history.now();
            // Perhaps a broken connection (the host was killed): connect again.
            if let Outcome::Failed(_) = &outcome {
                handler = None;
            }
            history.op(Op {
                client: self.id,
                host: self.host,
                kind,
                key,
                version: if kind == Kind::Store { version } else { 0 },
                start,
                end,
                outcome,
            });
            std::thread::sleep(Duration::from_millis(rng.gen_range(0..20)));
        }
    }
}

fn store(h: &maru::Handler, key: &str, bytes: &[u8]) -> maru::Result<()> {
    let mut a = h.alloc(bytes.len() as u64)?;
    a.as_mut_slice().copy_from_slice(bytes);
    h.store(key, a)
}

fn outcome(r: maru::Result<()>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(maru::Error::NotFound(_)) => Outcome::NotFound,
        Err(maru::Error::Exists(_)) => Outcome::Exists,
        Err(e) => Outcome::Failed(format!("{e:?}")),
    }
}

/// A retrieve, its bytes checked.
pub fn read(h: &maru::Handler, key: &str) -> Outcome {
    match h.retrieve(key) {
        Ok(Some(m)) => match parse(key, m.as_slice()) {
            Ok((version, checksum)) => Outcome::Read { version, checksum },
            Err(why) => Outcome::Corrupt(format!(
                "{why} (checksum {:#x}, {} bytes at {:#x} of pool {}, generation {})",
                fnv(m.as_slice()),
                m.len(),
                m.offset(),
                m.pool(),
                m.generation()
            )),
        },
        Ok(None) | Err(maru::Error::NotFound(_)) => Outcome::NotFound,
        Err(e) => Outcome::Failed(format!("{e:?}")),
    }
}

/// What a fill of the pool stored ([`fill`]).
#[derive(Debug, Default)]
pub struct Filled {
    /// The entries stored, with their namespace.
    pub keys: Vec<String>,
    pub bytes: u64,
    /// The error that stopped it, if not `ENOSPC`.
    pub failed: Option<String>,
}

impl Filled {
    /// Stores entries of 8 MiB, then of one claim unit (2 MiB: what is left between 8 MiB
    /// regions), named `ns/<prefix>N`, through `h` until the pool has no room or a store
    /// fails otherwise.
    pub fn more(&mut self, h: &maru::Handler, prefix: &str) {
        let unit = maru_cluster::UNIT;
        for size in [4 * unit, unit] {
            loop {
                let n = self.keys.len() as u64;
                let key = format!("{}/{prefix}{n}", NS);
                let res = h.alloc(size).and_then(|mut a| {
                    a.as_mut_slice()[..8].copy_from_slice(&n.to_le_bytes());
                    h.store(&key, a)
                });
                match res {
                    Ok(()) => {
                        self.keys.push(key);
                        self.bytes += size;
                    }
                    Err(maru::Error::NoSpace(_)) => break,
                    Err(e) => {
                        self.failed = Some(e.to_string());
                        return;
                    }
                }
            }
        }
    }
}

/// Fills the pool through `h` ([`Filled::more`]).
pub fn fill(h: &maru::Handler, prefix: &str) -> Filled {
    let mut f = Filled::default();
    f.more(h, prefix);
    f
}
