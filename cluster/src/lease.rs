//! A member's etcd lease: kept alive in the background, and until when it is sure to be alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::etcd::{Client, Compare, LeaseKeeper, Op, Txn};

/// Nanoseconds of CLOCK_BOOTTIME: the clock a lease's validity is told in. Every process of
/// a host shares it, setting the time of day does not move it, and it goes on while the
/// host is suspended (as etcd's lease does).
pub fn boottime_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// What `Member::validity` keeps short of the lease's end: the time a client granted space
/// just before it has to finish writing before another host may carve that space again.
pub(crate) fn validity_guard(ttl: i64) -> u64 {
    ttl as u64 * 1_000_000_000 / 3
}

/// Until when a lease renewed (or granted) for `granted` seconds at `sent` is sure to be
/// alive, less the guard ([`validity_guard`]).
pub(crate) fn valid_until(sent: u64, granted: i64, ttl: i64) -> u64 {
    (sent + granted.max(0) as u64 * 1_000_000_000).saturating_sub(validity_guard(ttl))
}

/// What the renewals of a member's lease keep up to date, the same across its rejoins.
#[derive(Debug, Clone, Default)]
pub(crate) struct Renewed {
    /// Until when the lease is sure to be alive (`Member::validity`; 0: not now).
    pub(crate) valid: Arc<AtomicU64>,
    /// The revision of the last beat (`Member::beaten`).
    pub(crate) beaten: Arc<AtomicI64>,
    /// The etcd member (its index) the last renewal went through: one in touch with etcd's
    /// leader then, since the renewal's beat is a transaction (`Member::watch_entries`).
    pub(crate) through: Arc<AtomicUsize>,
}

impl Renewed {
    /// A renewal through member `at` made the lease sure until `until`, its beat at
    /// `revision`.
    pub(crate) fn renewed(&self, until: u64, revision: i64, at: usize) {
        self.valid.fetch_max(until, Ordering::AcqRel);
        self.beaten.fetch_max(revision, Ordering::AcqRel);
        self.through.store(at, Ordering::Release);
    }
}

/// The keys a renewal writes ([`beat`]).
#[derive(Debug, Clone)]
pub(crate) struct BeatKeys {
    /// `beats/<node>`, which the other hosts follow.
    pub(crate) beat: String,
    /// `entries.tick/<node>`, which this host's entry watch carries back.
    pub(crate) tick: String,
}

/// Writes this host's beat (`beats/<node>`: what etcd granted, in seconds), only while the
/// key is this lease's, and tells whether that was done in raft term `term`: the renewal's
/// proof, and what lets the other hosts see the renewals ([`crate::detector`]). A write
/// through raft (a disk sync on a quorum) at each renewal, a third of the TTL apart, where a
/// linearizable read was enough before the detector.
///
/// A renewal alone does not prove the lease lives on: renewals are not agreed through raft,
/// and a leader cut off from the other members goes on renewing leases until it notices
/// (for as long as it stays stuck, in etcd releases that do not check their leadership on a
/// renewal, 3.4.23 among them: etcd issue 15247), while the majority's new leader lets them
/// expire. A write is committed by a quorum, and a term has one leader: the same term in
/// both answers means the renewal reached the leader the quorum follows.
///
/// The same transaction writes the host's *tick* (`entries.tick/<node>`: `until`, the
/// validity the renewal earns), which its own entry watch carries back to it: the host
/// counts that validity only once the tick has come back, so a host whose view of the
/// entries lags (its watch stuck on a member cut off from the others) is fenced off as a
/// host whose lease is in doubt is ([`Tick`](crate::EntryEvent::Tick)).
///
/// `Some((false, _))`: answered in that term, but the key is not this lease's (the lease is
/// gone, or another host found the beats stopped and deleted it); `None`: not answered in
/// it. With the answer, the transaction's revision.
pub(crate) async fn beat(
    member: &Client,
    keys: &BeatKeys,
    lease: i64,
    (granted, until): (i64, u64),
    term: u64,
) -> Option<(bool, i64)> {
    // etcd answers a renewal of a lease it does not hold with a TTL of 0: nothing is written
    // then (a linearizable read, in a transaction of no operation, still tells the term).
    let write = (granted > 0).then(|| {
        [
            Op::put(keys.beat.clone(), granted.to_string(), lease),
            Op::put(keys.tick.clone(), until.to_string(), lease),
        ]
    });
    let txn = Txn::new()
        .when([Compare::lease_is(keys.beat.clone(), lease)])
        .and_then(write.into_iter().flatten());
    let r = member.txn(txn).await.ok()?;
    (term != 0 && r.raft_term() == term).then(|| (r.succeeded(), r.revision()))
}

/// What one renewal of a lease through one member found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Renewed, and the beat written in the renewal's term ([`beat`]): the lease is sure to
    /// be alive until then ([`boottime_ns`]: the moment the renewal was asked, plus what etcd
    /// granted, less the guard); and the beat's revision.
    Until(u64, i64),
    /// etcd (in the renewal's term) says the lease no longer exists, or that this host's
    /// beat is not the lease's any more: another host found the beats stopped.
    Gone,
    /// No answer within a third of the TTL, an error, or a beat not written in the
    /// renewal's term.
    Failed,
}

/// A third of the TTL (100 ms at least): how often a lease is renewed, and how long one
/// attempt may take.
pub(crate) fn period(ttl: i64) -> Duration {
    Duration::from_millis((ttl as u64 * 1000 / 3).max(100))
}

/// Renews lease `lease` (of `ttl` seconds) once through `member`, on `stream` (opened first
/// if it is None; left None after a failure, for a new one next time), and writes the beat
/// and tick `keys` that prove it ([`beat`]).
pub(crate) async fn renew(
    member: &Client,
    stream: &mut Option<LeaseKeeper>,
    (lease, keys): (i64, &BeatKeys),
    ttl: i64,
) -> Renewal {
    let sent = boottime_ns();
    let attempt = async {
        if stream.is_none() {
            *stream = member.lease_keep_alive(lease).await.ok();
        }
        let (granted, term) = stream.as_mut()?.renew().await.ok()?;
        let until = valid_until(sent, granted, ttl);
        Some((
            granted,
            until,
            beat(member, keys, lease, (granted, until), term).await?,
        ))
    };
    match tokio::time::timeout(period(ttl), attempt).await {
        Ok(Some((granted, until, (true, revision)))) if granted > 0 => {
            Renewal::Until(until, revision)
        }
        // No TTL, yet the beat is still the lease's: not an answer to count on.
        Ok(Some((_, _, (true, _)))) => {
            *stream = None;
            Renewal::Failed
        }
        Ok(Some((_, _, (false, _)))) => Renewal::Gone,
        _ => {
            *stream = None;
            Renewal::Failed
        }
    }
}

/// Keeps the lease alive every third of its TTL; marks the member not live when etcd says
/// the lease is gone, or when no renewal succeeded for a whole TTL (etcd unreachable). Each
/// renewal moves the validity (`Member::validity`) on from the moment it was asked, and the
/// revision of the last beat (`Member::beaten`).
///
/// `members` holds a client per etcd member: renewals ([`renew`]) go to one member until it
/// fails (a member cut off from its quorum, one that does not answer), then at once to the
/// next, so that one member without a leader does not cost the lease.
pub(crate) async fn keep_alive(
    members: Vec<Client>,
    (lease, keys): (i64, BeatKeys),
    ttl: i64,
    (live, renewed): (Arc<AtomicBool>, Renewed),
    node: String,
) {
    let mut last_ok = tokio::time::Instant::now();
    let mut at = 0;
    let mut stream = None;
    let lost = || {
        renewed.valid.store(0, Ordering::Release);
        live.store(false, Ordering::Release);
    };
    loop {
        match renew(&members[at], &mut stream, (lease, &keys), ttl).await {
            Renewal::Until(until, revision) => {
                renewed.renewed(until, revision, at);
                last_ok = tokio::time::Instant::now();
                tracing::debug!(node, lease, member = at, "lease renewed");
                tokio::time::sleep(period(ttl)).await;
                continue;
            }
            Renewal::Gone => {
                tracing::warn!(
                    node,
                    lease,
                    "etcd lease expired (or revoked by another host)"
                );
                lost();
                return;
            }
            // This member failed: the next one, at once, on a new stream.
            Renewal::Failed => {
                tracing::debug!(node, lease, member = at, "lease renewal failed");
                at = (at + 1) % members.len();
            }
        }
        if last_ok.elapsed() >= Duration::from_secs(ttl as u64) {
            tracing::warn!(node, lease, "etcd unreachable for a whole lease TTL");
            lost();
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
