//! The clients: each a thread on one host, with a PRNG of its own seeded from the run's seed,
//! storing, retrieving, deleting, pinning, holding (socket clients) and listing keys of one
//! namespace — through libmaru on the host's control socket, or as files under the host's
//! mount — and recording every operation in the history.

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

/// The path of a key under a host's mount while the host runs with its mount up.
pub type MountPath = Box<dyn Fn(&str) -> Option<PathBuf> + Send>;

/// How a client reaches its host.
pub enum Door {
    /// libmaru, over the host's control socket.
    Socket,
    /// Files under the host's mount: the path of a key there while the host runs with its
    /// mount up (None otherwise). The control socket only tells when a store's publication,
    /// which follows the writer's `close` (at the kernel's release), has landed.
    Mount(MountPath),
}

/// One client's part of the workload.
pub struct Client {
    pub id: u32,
    pub host: usize,
    pub socket: PathBuf,
    pub door: Door,
    pub keys: u64,
    pub seed: u64,
}

impl Client {
    /// Runs until `stop`; every operation goes to `history`.
    pub fn run(self, history: Arc<History>, stop: Arc<AtomicBool>) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ (u64::from(self.id) << 40));
        let mut handler: Option<maru::Handler> = None;
        let mut n = 0u64;
        // The keys this connection holds (one each per hold), gone with the connection.
        let mut held: Vec<String> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let Some(h) = handler.as_ref() else {
                handler = connect(&self.socket, Duration::from_millis(500));
                held.clear();
                continue;
            };
            let mut key = key(rng.gen_range(0..self.keys));
            let roll = rng.gen_range(0..100u32);
            let kind = match (roll, &self.door) {
                (0..35, _) => Kind::Store,
                (35..70, _) => Kind::Retrieve,
                (70..82, _) => Kind::Delete,
                (82..86, _) => Kind::Pin,
                (86..88, _) => Kind::Unpin,
                (88..92, Door::Socket) => Kind::Hold,
                (92..95, Door::Socket) => Kind::Unhold,
                _ => Kind::List,
            };
            if kind == Kind::Unhold && !held.is_empty() {
                key = held.swap_remove(rng.gen_range(0..held.len()));
            }
            n += 1;
            let version = (u64::from(self.id) << 32) | n;
            let len = rng.gen_range(64..=(256 << 10));
            let start = history.now();
            history.begin(self.id, self.host, kind, &key, start);
            let outcome = match &self.door {
                Door::Socket => match kind {
                    Kind::Store => outcome(store(h, &key, &entry(&key, version, len))),
                    Kind::Retrieve => read(h, &key),
                    Kind::Delete => outcome(h.delete(&key)),
                    Kind::Pin => outcome(h.pin(&key)),
                    Kind::Unpin => outcome(h.unpin(&key)),
                    Kind::Hold => {
                        let r = outcome(h.hold(&key));
                        if r == Outcome::Ok {
                            held.push(key.clone());
                        }
                        r
                    }
                    Kind::Unhold => outcome(h.unhold(&key)),
                    Kind::List => outcome(h.list(NS).map(|_| ())),
                },
                Door::Mount(at) => match at(&key) {
                    Some(path) => mount::op(h, kind, &key, &path, || entry(&key, version, len)),
                    None => Outcome::Failed("the host's mount is down".into()),
                },
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

/// The operations as files under a host's mount.
mod mount {
    use std::io::Write;
    use std::os::fd::IntoRawFd;
    use std::path::Path;

    use crate::faults::history::{Kind, Outcome, fnv, parse};

    /// `kind` on `key`, whose path under the mount is `path`; `bytes` makes a store's.
    pub fn op(
        h: &maru::Handler,
        kind: Kind,
        key: &str,
        path: &Path,
        bytes: impl FnOnce() -> Vec<u8>,
    ) -> Outcome {
        let r = match kind {
            Kind::Store => return store(h, key, path, &bytes()),
            Kind::Retrieve => return read(key, path),
            Kind::Delete => std::fs::remove_file(path),
            Kind::Pin => pin(path, true),
            Kind::Unpin => pin(path, false),
            Kind::Hold | Kind::Unhold => unreachable!("a hold is the control socket's"),
            Kind::List => path
                .parent()
                .map_or(Ok(()), |ns| std::fs::read_dir(ns).map(|d| d.for_each(drop))),
        };
        match r {
            Ok(()) => Outcome::Ok,
            Err(e) => io(e, kind),
        }
    }

    /// A store as a careful writer makes one (doc/SEMANTICS.md): create the name, write,
    /// close (whose answer is the commit's: the name and room reserved), unlinking the name
    /// before the close when a write fails. Acknowledged once the other door serves this
    /// store's bytes under the name: the publication itself follows the close, at the
    /// kernel's release. (Seed 2484: a publication that failed at the release was
    /// acknowledged, since the other door saw the name, stored by another client meanwhile.)
    fn store(h: &maru::Handler, key: &str, path: &Path, bytes: &[u8]) -> Outcome {
        let mut f = match std::fs::File::create_new(path) {
            Ok(f) => f,
            Err(e) => return io(e, Kind::Store),
        };
        if let Err(e) = f.write_all(bytes) {
            let _ = std::fs::remove_file(path);
            return io(e, Kind::Store);
        }
        if let Err(e) = nix::unistd::close(f.into_raw_fd()) {
            return io(e.into(), Kind::Store);
        }
        match h.retrieve(key) {
            Ok(Some(m)) if m.as_slice() == bytes => Outcome::Ok,
            Ok(Some(_)) => Outcome::Failed("closed, but another entry has the name".into()),
            Ok(None) => Outcome::Failed("closed, but not published".into()),
            Err(e) => Outcome::Failed(format!("{e:?}")),
        }
    }

    /// A read of the whole file, its bytes checked.
    fn read(key: &str, path: &Path) -> Outcome {
        match std::fs::read(path) {
            Ok(b) => match parse(key, &b) {
                Ok((version, checksum)) => Outcome::Read { version, checksum },
                Err(why) => Outcome::Corrupt(format!(
                    "{why} (checksum {:#x}, {} bytes, through the mount)",
                    fnv(&b),
                    b.len()
                )),
            },
            Err(e) => io(e, Kind::Retrieve),
        }
    }

    /// Sets `user.maru.pinned` (the operator's pin, as `maructl pin` does).
    fn pin(path: &Path, pinned: bool) -> std::io::Result<()> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
        let v: &[u8] = if pinned { b"1" } else { b"0" };
        // SAFETY: valid C strings, and a value of `v.len()` bytes.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"user.maru.pinned".as_ptr(),
                v.as_ptr().cast(),
                v.len(),
                0,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// What an error of the mount means for the history: a missing name is `NotFound` (a
    /// store's, whose namespace is there, cannot be: it failed), a name taken `Exists`.
    fn io(e: std::io::Error, kind: Kind) -> Outcome {
        match e.raw_os_error() {
            Some(libc::ENOENT) if kind != Kind::Store => Outcome::NotFound,
            Some(libc::EEXIST) if kind == Kind::Store => Outcome::Exists,
            _ => Outcome::Failed(format!("{e}")),
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
    /// The error that stopped it, if not `ENOSPC` nor one worth trying again after.
    pub failed: Option<String>,
    /// The error that stopped it last, if one worth trying again after: the host fenced off
    /// (`EBUSY`), or etcd out of its reach for now (an I/O error: right after a partition
    /// heals, its connections may still find no route for a moment, seed 2166).
    pub transient: Option<String>,
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
                        self.transient = None;
                    }
                    Err(maru::Error::NoSpace(_)) => break,
                    Err(e @ (maru::Error::Busy(_) | maru::Error::Io(_))) => {
                        self.transient = Some(e.to_string());
                        return;
                    }
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
