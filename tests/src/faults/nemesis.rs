//! The nemesis: faults at random, one at a time, while the workload runs, each healed before
//! the next; every fault recorded with its start and end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::env::{Env, MEMBERS};
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
    /// `kill -9` of an etcd member (the leader one time in two), restarted after a moment.
    EtcdKill,
    /// A compaction of etcd's keyspace at its current revision.
    Compact,
    /// One etcd member cut from the other two (a minority and a majority), every host still
    /// reaching all three; or, one time in two, one host also cut from the majority, so that
    /// it reaches only the member without a quorum.
    EtcdPartition,
    /// The pool filled by one host's client (8 MiB entries, then 2 MiB ones, until `ENOSPC`)
    /// for a moment, then emptied again.
    Full,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Kill,
        Kind::Pause,
        Kind::Partition,
        Kind::EtcdKill,
        Kind::Compact,
        Kind::EtcdPartition,
        Kind::Full,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Pause => "pause",
            Kind::Partition => "partition",
            Kind::EtcdKill => "etcd-kill",
            Kind::Compact => "compact",
            Kind::EtcdPartition => "etcd-partition",
            Kind::Full => "full",
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
        // A partition starts once it holds (its routes are all in place): the recovery
        // bounds run from there, like the cut's own clock (`cut_off`).
        let mut start = history.now();
        let mut cut = CutOff::default();
        let target = match kind {
            Kind::Kill => {
                let mut d = env.hosts[host].lock().expect("host");
                d.kill9();
                // Stuck in its exit (a thread of it waits on a lock held by a request to its
                // own mount): its successor must end it.
                let stuck = d.dying().is_some();
                std::thread::sleep(ms(&mut rng, 100, 1500));
                d.restart();
                format!("h{host}{}", if stuck { " (stuck in its exit)" } else { "" })
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
                start = history.now();
                let planned = ttl + ms(&mut rng, 500, 2500);
                cut = cut_off(env, host, None, planned);
                env.net.link(host, true);
                format!("h{host}")
            }
            Kind::EtcdPartition => {
                let m = rng.gen_range(0..MEMBERS);
                let with_host = rng.gen_bool(0.5);
                let planned = ttl + ms(&mut rng, 500, 2500);
                let split = |cut: bool| {
                    for o in (0..MEMBERS).filter(|&o| o != m) {
                        env.net
                            .block(&env.net.members[m], &env.net.member_ip(o), cut);
                        env.net
                            .block(&env.net.members[o], &env.net.member_ip(m), cut);
                        if with_host {
                            env.net
                                .block(&env.net.hosts[host], &env.net.member_ip(o), cut);
                        }
                    }
                };
                let known = env.etcd.lock().expect("etcd").leader(m);
                let minority = known.map(|s| Minority {
                    member: m,
                    id: s.id,
                    leader: s.leader,
                });
                split(true);
                start = history.now();
                if with_host {
                    cut = cut_off(env, host, minority, planned);
                } else {
                    std::thread::sleep(planned);
                }
                split(false);
                if with_host {
                    format!("m{m}+h{host}")
                } else {
                    format!("m{m}")
                }
            }
            Kind::Full => {
                full(env, host, ms(&mut rng, 500, 2000));
                format!("h{host}")
            }
            Kind::EtcdKill => {
                let mut e = env.etcd.lock().expect("etcd");
                // The leader one time in two (when one leads), another member otherwise.
                let any = rng.gen_range(0..e.len());
                let leader = if rng.gen_bool(0.5) {
                    e.leader_member()
                } else {
                    None
                };
                let m = leader.unwrap_or(any);
                e.kill(m);
                std::thread::sleep(ms(&mut rng, 200, 3000));
                e.restart(m);
                format!("m{m}{}", if leader.is_some() { " (leader)" } else { "" })
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
            released: cut.released,
            alive_at: cut.alive_at,
            elected: cut.elected,
        });
    }
}

/// The member an etcd partition cut from the others, with its id and the leader it knew.
#[derive(Clone, Copy)]
struct Minority {
    member: usize,
    id: u64,
    leader: u64,
}

/// How a cut went, in µs after it.
#[derive(Default)]
struct CutOff {
    /// When a read of etcd found the host's lease dropped (the read's end).
    released: Option<u64>,
    /// When the last read that still found the lease began.
    alive_at: Option<u64>,
    /// When etcd last elected a leader meanwhile.
    elected: Option<u64>,
}

/// Holds host `host` cut off etcd (its lease kept alive by nothing) for `planned`, and at
/// least until etcd dropped its lease (a second past the bound, TTL + 1 s, at most); when
/// etcd dropped it, between the last read that found it and the first that did not, and
/// when etcd last elected a leader meanwhile. `minority`: the member the host still reaches,
/// cut from the others (not asked whether the lease lives, nor who leads). etcd renews every
/// lease when a new leader takes over, so the lease's TTL runs again from there: the cut
/// lasts until TTL + 2 s after the last election too (15 s at most).
fn cut_off(env: &Env, host: usize, minority: Option<Minority>, planned: Duration) -> CutOff {
    let cut = Instant::now();
    let planned = cut + planned;
    let margin = env.ttl + Duration::from_secs(2);
    // The leader the members with a quorum follow, and the newest term among them; an
    // election during the cut (any cut: a member back from a partition of its own forces
    // one, which the same leader may win again, in a new term) renews every lease.
    let leads = || {
        let etcd = env.etcd.lock().expect("etcd");
        let known: Vec<_> = (0..MEMBERS)
            .filter(|&o| Some(o) != minority.map(|m| m.member))
            .filter_map(|o| etcd.leader(o))
            .collect();
        let leader = known.iter().map(|s| s.leader).find(|&l| l != 0);
        (leader, known.iter().map(|s| s.term).max().unwrap_or(0))
    };
    let (now_leads, mut term) = leads();
    let mut leader = minority.map(|m| m.leader).or(now_leads);
    let mut released = None;
    let mut alive_at = None;
    let mut elected: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let (now_leads, now_term) = leads();
        if now_leads.is_some() && (now_leads != leader || now_term > term) {
            leader = now_leads;
            elected = Some(now);
        }
        term = term.max(now_term);
        let waits_election = minority.is_some_and(|m| leader == Some(m.id));
        let from = if waits_election {
            now.min(cut + Duration::from_secs(13))
        } else {
            elected.unwrap_or(cut)
        };
        if now >= planned.max(from + margin) {
            break;
        }
        if released.is_none() {
            // A read may take long (a member catching up): the lease went between the
            // beginning of the last read that found it and the end of the first that did not.
            let began = cut.elapsed().as_micros() as u64;
            if env.node_alive(host, minority.map(|m| m.member)) {
                alive_at = Some(began);
            } else {
                released = Some(cut.elapsed().as_micros() as u64);
            }
        }
        if released.is_some() && now >= planned && !waits_election {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let since = |t: Instant| t.duration_since(cut).as_micros() as u64;
    CutOff {
        released,
        alive_at,
        elected: elected.map(since),
    }
}

/// Fills the pool from host `host` ([`super::workload::fill`]), holds it full for `hold`,
/// and deletes what it stored (each delete tried for up to 10 s: the fault leaves nothing behind).
fn full(env: &Env, host: usize, hold: Duration) {
    let Some(h) = env.connect(host, Duration::from_secs(5)) else {
        return;
    };
    let filled = super::workload::fill(&h, "full");
    std::thread::sleep(hold);
    for key in &filled.keys {
        let t = Instant::now();
        while !matches!(h.delete(key), Ok(()) | Err(maru::Error::NotFound(_)))
            && t.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
