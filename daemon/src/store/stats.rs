//! Statistics as atomics: counting a request never takes the store's lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use maru::proto::LATENCY_BUCKETS_US;
use maru_fsd::Upcall;

/// The control operations counted by name (`maru::proto::Op::name`), plus `errors`,
/// `lane_requests` (requests taken from connections' shared-memory lanes) and
/// `connections_refused` (connections over `--max-connections`).
pub const OPS: [&str; 22] = [
    "hello",
    "mkdir",
    "rmdir",
    "set_quota",
    "alloc",
    "free",
    "publish",
    "retrieve",
    "release",
    "accessed",
    "exists",
    "delete",
    "pin",
    "hold",
    "index",
    "list",
    "stats",
    "evict",
    "lane",
    "errors",
    "lane_requests",
    "connections_refused",
];

/// Kinds of bytes counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bytes {
    /// Published.
    Stored,
    /// Retrieved over the socket.
    Retrieved,
    /// Deleted.
    Deleted,
    /// Evicted.
    Evicted,
}

impl Bytes {
    const ALL: [Bytes; 4] = [
        Bytes::Stored,
        Bytes::Retrieved,
        Bytes::Deleted,
        Bytes::Evicted,
    ];

    fn name(self) -> &'static str {
        match self {
            Bytes::Stored => "stored",
            Bytes::Retrieved => "retrieved",
            Bytes::Deleted => "deleted",
            Bytes::Evicted => "evicted",
        }
    }
}

const BUCKETS: usize = LATENCY_BUCKETS_US.len() + 1;

/// Counters of the store and of its two doors.
pub struct Counters {
    ops: [AtomicU64; OPS.len()],
    latency: [[AtomicU64; BUCKETS]; OPS.len()],
    latency_sum: [AtomicU64; OPS.len()],
    upcalls: [AtomicU64; Upcall::ALL.len()],
    bytes: [AtomicU64; Bytes::ALL.len()],
}

fn zeroes<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            ops: zeroes(),
            latency: std::array::from_fn(|_| zeroes()),
            latency_sum: zeroes(),
            upcalls: zeroes(),
            bytes: zeroes(),
        }
    }
}

fn op_index(op: &str) -> Option<usize> {
    OPS.iter().position(|o| *o == op)
}

impl Counters {
    /// Counts one control operation (an unknown name, which would be a new request kind
    /// missing from [`OPS`], is not counted: tests catch that).
    pub fn count(&self, op: &str) {
        debug_assert!(op_index(op).is_some(), "`{op}` is not in stats::OPS");
        if let Some(i) = op_index(op) {
            self.ops[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the latency of one control operation.
    pub fn record_latency(&self, op: &str, d: Duration) {
        let Some(i) = op_index(op) else { return };
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let b = LATENCY_BUCKETS_US.partition_point(|&ub| ub < us);
        self.latency[i][b].fetch_add(1, Ordering::Relaxed);
        self.latency_sum[i].fetch_add(us, Ordering::Relaxed);
    }

    /// Counts one FUSE upcall.
    pub fn count_upcall(&self, op: Upcall) {
        self.upcalls[op as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` bytes of `kind`.
    pub fn add_bytes(&self, kind: Bytes, n: u64) {
        self.bytes[kind as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// Operation counters by name (`fuse_<op>` for upcalls), non-zero ones only.
    pub fn ops(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for (name, n) in OPS.iter().zip(&self.ops) {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                m.insert((*name).to_owned(), n);
            }
        }
        for (op, n) in Upcall::ALL.iter().zip(&self.upcalls) {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                m.insert(format!("fuse_{}", op.name()), n);
            }
        }
        m
    }

    /// Bytes by kind.
    pub fn bytes(&self) -> BTreeMap<String, u64> {
        Bytes::ALL
            .iter()
            .map(|b| {
                (
                    b.name().to_owned(),
                    self.bytes[*b as usize].load(Ordering::Relaxed),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Latency histograms and sums (µs) of the operations seen.
    pub fn latency(&self) -> (BTreeMap<String, Vec<u64>>, BTreeMap<String, u64>) {
        let mut h = BTreeMap::new();
        let mut s = BTreeMap::new();
        for (i, name) in OPS.iter().enumerate() {
            let counts: Vec<u64> = self.latency[i]
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect();
            if counts.iter().any(|c| *c > 0) {
                h.insert((*name).to_owned(), counts);
                s.insert(
                    (*name).to_owned(),
                    self.latency_sum[i].load(Ordering::Relaxed),
                );
            }
        }
        (h, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_ops_bytes_and_latency() {
        let c = Counters::default();
        c.count("retrieve");
        c.count("retrieve");
        c.count_upcall(Upcall::Open);
        c.add_bytes(Bytes::Stored, 10);
        c.record_latency("retrieve", Duration::from_micros(3));
        let ops = c.ops();
        assert_eq!(ops["retrieve"], 2);
        assert_eq!(ops["fuse_open"], 1);
        assert_eq!(ops.len(), 2);
        assert_eq!(c.bytes()["stored"], 10);
        let (h, s) = c.latency();
        assert_eq!(h["retrieve"].iter().sum::<u64>(), 1);
        assert_eq!(s["retrieve"], 3);
    }
}
