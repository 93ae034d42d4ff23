//! The nemesis: faults at random, one at a time, while the workload runs, each healed before
//! the next; every fault recorded with its start and end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::env::Env;
use super::history::{Fault, History};

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `kill -9` of a marud, restarted after a moment.
    Kill,
    /// SIGSTOP of a marud for longer than the lease TTL, then SIGCONT.
    Pause,
    /// A host cut from the hub (etcd and the other hosts) for longer than the TTL.
    Partition,
    /// `kill -9` of an etcd member (the leader as often as not), restarted after a moment.
    EtcdKill,
    /// A compaction of etcd's keyspace at its current revision.
    Compact,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Kill,
        Kind::Pause,
        Kind::Partition,
        Kind::EtcdKill,
        Kind::Compact,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Pause => "pause",
            Kind::Partition => "partition",
            Kind::EtcdKill => "etcd-kill",
            Kind::Compact => "compact",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// Applies faults of `kinds` until `until`, then returns with everything healed.
pub fn run(env: &Env, history: &Arc<History>, kinds: &[Kind], seed: u64, until: Instant) {
    if kinds.is_empty() {
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x006e_656d_6573_6973);
    let ttl = env.ttl;
    let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.gen_range(lo..hi));
    loop {
        let gap = ms(&mut rng, 500, 2000);
        if Instant::now() + gap >= until {
            break;
        }
        std::thread::sleep(gap);
        let kind = kinds[rng.gen_range(0..kinds.len())];
        let host = rng.gen_range(0..env.hosts.len());
        let start = history.now();
        let mut released = None;
        let target = match kind {
            Kind::Kill => {
                let mut d = env.hosts[host].lock().expect("host");
                d.kill9();
                std::thread::sleep(ms(&mut rng, 100, 1500));
                d.restart();
                format!("h{host}")
            }
            Kind::Pause => {
                let pid = env.hosts[host].lock().expect("host").pid() as i32;
                // SAFETY: signals to a child of ours, by pid.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                std::thread::sleep(ttl + ms(&mut rng, 500, 2500));
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                format!("h{host}")
            }
            Kind::Partition => {
                env.net.link(host, false);
                let cut = Instant::now();
                // The link stays cut as drawn, and at least until etcd dropped the host's
                // lease (a second past the bound, TTL + 1 s, at most).
                let planned = cut + ttl + ms(&mut rng, 500, 2500);
                let longest = planned.max(cut + ttl + Duration::from_secs(2));
                while Instant::now() < longest {
                    if released.is_none() && !env.node_alive(host) {
                        released = Some(cut.elapsed().as_micros() as u64);
                    }
                    if released.is_some() && Instant::now() >= planned {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                env.net.link(host, true);
                format!("h{host}")
            }
            Kind::EtcdKill => {
                let mut e = env.etcd.lock().expect("etcd");
                let m = rng.gen_range(0..e.len());
                e.kill(m);
                std::thread::sleep(ms(&mut rng, 200, 3000));
                e.restart(m);
                format!("m{m}")
            }
            Kind::Compact => {
                let rev = env.etcd.lock().expect("etcd").compact();
                format!("revision {rev:?}")
            }
        };
        history.fault(Fault {
            kind: kind.name().into(),
            target,
            start,
            end: history.now(),
            released,
        });
    }
}
