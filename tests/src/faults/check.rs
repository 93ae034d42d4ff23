//! The checker: reads a history and finds the outcomes that maru's cluster promises forbid.
//! Every rule allows only what a correct cluster could do, given that a host's view of the
//! others' publications and deletes may lag by up to `lag` (the convergence bound): a
//! violation it reports is one no interleaving of the recorded operations explains.

use std::collections::BTreeMap;
use std::time::Duration;

use super::history::{Fault, Kind, Op, Outcome};

/// Findings, one line each.
pub fn check(ops: &[Op], lag_us: u64) -> Vec<String> {
    let mut v = Vec::new();
    let mut by_key: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in ops {
        by_key.entry(&op.key).or_default().push(op);
    }
    for (key, ops) in by_key {
        let stores: Vec<&Op> = ops
            .iter()
            .copied()
            .filter(|o| o.kind == Kind::Store)
            .collect();
        // A delete that may have deleted something: acknowledged, or of unknown outcome.
        let deletes: Vec<&Op> = ops
            .iter()
            .copied()
            .filter(|o| {
                o.kind == Kind::Delete && matches!(o.outcome, Outcome::Ok | Outcome::Failed(_))
            })
            .collect();
        let reads: Vec<(&Op, u64)> = ops
            .iter()
            .filter_map(|o| match o.outcome {
                Outcome::Read { version, .. } => Some((*o, version)),
                _ => None,
            })
            .collect();
        let store_of = |version: u64| stores.iter().find(|s| s.version == version);
        // 1. Whole bytes, of a version some client stored (and had begun storing).
        for o in &ops {
            if let Outcome::Corrupt(why) = &o.outcome {
                v.push(format!(
                    "{key}: read on h{} at {} µs: {why}",
                    o.host, o.start
                ));
            }
        }
        for &(r, version) in &reads {
            match store_of(version) {
                Some(s) if s.start < r.end => {}
                _ => v.push(format!(
                    "{key}: read on h{} at {} µs returned version {version:#x}, never stored before",
                    r.host, r.start
                )),
            }
        }
        // 2. A name is published once: two acknowledged stores need a delete between them.
        let acked: Vec<&Op> = stores
            .iter()
            .copied()
            .filter(|s| s.outcome == Outcome::Ok)
            .collect();
        for (i, a) in acked.iter().enumerate() {
            for b in &acked[i + 1..] {
                let (lo, hi) = (a.start.min(b.start), a.end.max(b.end));
                if !deletes.iter().any(|d| d.start < hi && d.end > lo) {
                    v.push(format!(
                        "{key}: published twice with no delete between: version {:#x} on h{} \
                         ({}..{} µs) and {:#x} on h{} ({}..{} µs)",
                        a.version, a.host, a.start, a.end, b.version, b.host, b.start, b.end
                    ));
                }
            }
        }
        // 3. Never two contents without a delete between the reads (give or take the lag).
        for (i, &(a, va)) in reads.iter().enumerate() {
            for &(b, vb) in &reads[i + 1..] {
                if va == vb {
                    continue;
                }
                let (lo, hi) = (a.start.min(b.start), a.end.max(b.end));
                if !deletes.iter().any(|d| d.start < hi && d.end + lag_us > lo) {
                    v.push(format!(
                        "{key}: read as {va:#x} on h{} ({}..{} µs) and as {vb:#x} on h{} \
                         ({}..{} µs) with no delete between",
                        a.host, a.start, a.end, b.host, b.start, b.end
                    ));
                }
            }
        }
        // 4. No read of an entry deleted (acknowledged) after it was stored and before the
        //    read began, the lag aside.
        for &(r, version) in &reads {
            let Some(s) = store_of(version) else { continue };
            if let Some(d) = deletes.iter().find(|d| {
                d.outcome == Outcome::Ok && d.start > s.end + lag_us && d.end + lag_us < r.start
            }) {
                v.push(format!(
                    "{key}: read on h{} at {} µs returned version {version:#x}, stored by {} µs \
                     and deleted on h{} at {}..{} µs",
                    r.host, r.start, s.end, d.host, d.start, d.end
                ));
            }
        }
        // 5. An acknowledged store that no delete may have undone is read, whole, by every
        //    host after the run (the checker's own reads, client u32::MAX).
        for s in &acked {
            if deletes.iter().any(|d| d.end > s.start) {
                continue;
            }
            for f in ops
                .iter()
                .filter(|o| o.client == u32::MAX && o.kind == Kind::Retrieve)
            {
                if !matches!(f.outcome, Outcome::Read { version, .. } if version == s.version) {
                    v.push(format!(
                        "{key}: version {:#x} stored on h{} (acknowledged at {} µs) and never \
                         deleted, but h{} reads {:?} after the run",
                        s.version, s.host, s.end, f.host, f.outcome
                    ));
                }
            }
        }
    }
    v
}

/// Extents of live entries `(offset, size, key)`: none overlaps another or leaves the pool.
pub fn extents(mut spans: Vec<(u64, u64, String)>, pool_size: u64) -> Vec<String> {
    let mut v = Vec::new();
    spans.sort();
    for w in spans.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            v.push(format!(
                "{} at {:#x}+{:#x} and {} at {:#x} share bytes of the pool",
                w[0].2, w[0].0, w[0].1, w[1].2, w[1].0
            ));
        }
    }
    for (off, len, key) in &spans {
        if off + len > pool_size {
            v.push(format!(
                "{key} at {off:#x}+{len:#x} lies past the pool's end"
            ));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(host: usize, kind: Kind, version: u64, t: (u64, u64), outcome: Outcome) -> Op {
        Op {
            client: host as u32,
            host,
            kind,
            key: "ns/k0".into(),
            version,
            start: t.0,
            end: t.1,
            outcome,
        }
    }

    fn read(version: u64) -> Outcome {
        Outcome::Read {
            version,
            checksum: 0,
        }
    }

    #[test]
    fn the_checker_finds_what_it_should_and_passes_what_it_should() {
        let s1 = op(0, Kind::Store, 1, (0, 10), Outcome::Ok);
        let s2 = op(1, Kind::Store, 2, (20, 30), Outcome::Ok);
        let d = op(2, Kind::Delete, 0, (12, 15), Outcome::Ok);
        let r1 = op(0, Kind::Retrieve, 0, (11, 12), read(1));
        let r2 = op(1, Kind::Retrieve, 0, (40, 41), read(2));
        // A history a correct cluster produces.
        let good = [s1.clone(), d.clone(), s2.clone(), r1.clone(), r2.clone()];
        assert_eq!(check(&good, 0), Vec::<String>::new());
        // Without the delete: published twice, read two ways.
        let bad = [s1.clone(), s2.clone(), r1.clone(), r2.clone()];
        assert_eq!(check(&bad, 0).len(), 2, "{:?}", check(&bad, 0));
        // A read of a deleted version, long after the delete.
        let late = op(1, Kind::Retrieve, 0, (100, 101), read(1));
        let s1 = op(0, Kind::Store, 1, (0, 10), Outcome::Ok);
        assert_eq!(check(&[s1.clone(), d.clone(), late.clone()], 0).len(), 1);
        // A phantom, a torn read, and an acknowledged store lost after the run.
        let phantom = op(1, Kind::Retrieve, 0, (5, 6), read(9));
        let torn = op(
            1,
            Kind::Retrieve,
            0,
            (5, 6),
            Outcome::Corrupt("bad checksum".into()),
        );
        let mut fin = op(2, Kind::Retrieve, 0, (200, 201), Outcome::NotFound);
        fin.client = u32::MAX;
        assert_eq!(check(&[s1.clone(), phantom, torn, fin], 0).len(), 3);
        assert_eq!(
            extents(vec![(0, 10, "a".into()), (5, 10, "b".into())], 100).len(),
            1
        );
    }

    #[test]
    fn a_release_bound_is_missed_only_when_a_read_begun_after_it_found_the_lease() {
        let ttl = Duration::from_secs(2);
        let cut = |released: Option<u64>, alive_at: Option<u64>, elected: Option<u64>| Fault {
            kind: "partition".into(),
            target: "h1".into(),
            start: 1_000_000,
            end: 6_000_000,
            released,
            alive_at,
            elected,
        };
        let missed = |f: Fault| recoveries(&[], &[f], ttl).1.len();
        // Within TTL + 1 s.
        assert_eq!(missed(cut(Some(2_500_000), Some(2_400_000), None)), 0);
        // Seen gone after the bound by a read that began before it: not shown late.
        assert_eq!(missed(cut(Some(3_300_000), Some(2_900_000), None)), 0);
        // Still found by a read begun after the bound: late.
        assert_eq!(missed(cut(Some(3_300_000), Some(3_100_000), None)), 1);
        // Never released while cut.
        assert_eq!(missed(cut(None, Some(4_000_000), None)), 1);
        // An election renews every lease: the bound runs from it, plus etcd's election timeout.
        assert_eq!(
            missed(cut(Some(5_200_000), Some(5_100_000), Some(1_500_000))),
            0
        );
        // A store the cut host acknowledged past its TTL.
        let late_store = op(1, Kind::Store, 1, (3_000_000, 3_100_000), Outcome::Ok);
        let (r, bad) = recoveries(
            std::slice::from_ref(&late_store),
            &[cut(Some(2_500_000), None, None)],
            ttl,
        );
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert_eq!(r[0].published_for, Some(Duration::from_micros(2_100_000)));
        // The same, as etcd elected a leader 1.9 s after the cut: the new leader committed a
        // publication the host had sent before the cut (seed 1993). Not past 2.9 s.
        let elected = cut(Some(5_200_000), Some(5_100_000), Some(1_900_000));
        assert_eq!(
            recoveries(&[late_store], std::slice::from_ref(&elected), ttl)
                .1
                .len(),
            0
        );
        let later = op(1, Kind::Store, 1, (3_000_000, 4_000_000), Outcome::Ok);
        assert_eq!(recoveries(&[later], &[elected], ttl).1.len(), 1);
    }
}

/// etcd's election timeout (its default, which the harness's members run with): a new
/// leader renews every lease by that much beyond its TTL (and the hosts' failure detector
/// counts a lease's TTL again from a new term).
pub const ELECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// How one partition went, against the promised bounds.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub host: String,
    /// The last store the cut host acknowledged, after the cut (None: none).
    pub published_for: Option<Duration>,
    /// When etcd dropped the cut host's lease, after the cut (None: not while it was cut):
    /// the end of the first read that found it gone.
    pub released: Option<Duration>,
    /// When the last read that still found the lease began, after the cut: etcd dropped it
    /// after that.
    pub alive_at: Option<Duration>,
    /// When etcd's majority elected a new leader, after the cut, if the host's member led.
    pub elected: Option<Duration>,
}

/// The recovery of each partition in `faults`: a host cut off stops publishing within the
/// TTL, and its claims are released (the other hosts may take its regions) within TTL + 1 s.
/// Both run from the cut, or from etcd's last election while the host was cut (plus the
/// election timeout), when that is later: a new leader commits what the old term left
/// replicated in its log, a publication the host sent before the cut among it, and the
/// member answers over a return path the cut may leave open (seed 1993: acknowledged 2.01 s
/// after the cut, as the majority's new leader was elected); and it renews every lease.
/// Returns them with the violations of those bounds. The release is known to lie between
/// the beginning of the last read of etcd that found the lease and the end of the first that
/// did not; the bound is missed when a read that began after it still found the lease (a
/// slow read that ended after the bound proves nothing).
pub fn recoveries(ops: &[Op], faults: &[Fault], ttl: Duration) -> (Vec<Recovery>, Vec<String>) {
    let mut out = Vec::new();
    let mut bad = Vec::new();
    // A host cut from etcd: by a partition, or from the majority of etcd's members.
    let cut = faults.iter().filter_map(|f| match f.kind.as_str() {
        "partition" => Some((f, f.target.as_str())),
        "etcd-partition" => f.target.split_once('+').map(|(_, h)| (f, h)),
        _ => None,
    });
    for (f, host) in cut {
        let published_for = ops
            .iter()
            .filter(|o| {
                format!("h{}", o.host) == host
                    && o.kind == Kind::Store
                    && o.outcome == Outcome::Ok
                    && o.end > f.start
                    && o.end <= f.end
            })
            .map(|o| Duration::from_micros(o.end - f.start))
            .max();
        let released = f.released.map(Duration::from_micros);
        let alive_at = f.alive_at.map(Duration::from_micros);
        // The TTL runs from the cut, or from the last election of an etcd leader while the
        // host was cut: etcd renews every lease then, by its election timeout (1 s) beyond
        // the TTL, and the other hosts' failure detector counts the TTL again from it.
        let renewed = f.elected.map_or(Duration::ZERO, |e| {
            Duration::from_micros(e) + ELECTION_TIMEOUT
        });
        let published_bound = ttl.max(renewed);
        if let Some(p) = published_for.filter(|p| *p > published_bound) {
            bad.push(format!(
                "{host} cut off at {} µs acknowledged a store {p:?} later (bound: the TTL, or \
                 etcd's election while it was cut and the election timeout: {published_bound:?})",
                f.start
            ));
        }
        let bound = ttl + Duration::from_secs(1) + renewed;
        match released {
            Some(_) if alive_at.is_none_or(|a| a <= bound) => {}
            Some(r) => bad.push(format!(
                "{host} cut off at {} µs: etcd still held its claims {:?} later, dropped them \
                 by {r:?} (bound {bound:?})",
                f.start,
                alive_at.unwrap_or_default()
            )),
            None => bad.push(format!(
                "{host} cut off at {} µs: etcd still held its claims when the link returned",
                f.start
            )),
        }
        out.push(Recovery {
            host: host.to_owned(),
            published_for,
            released,
            alive_at,
            elected: f.elected.map(Duration::from_micros),
        });
    }
    (out, bad)
}
