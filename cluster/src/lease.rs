//! A member's etcd lease: kept alive in the background, and until when it is sure to be alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::etcd::Client;

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

/// Keeps the lease alive every third of its TTL; marks the member not live when etcd says
/// the lease is gone, or when no renewal succeeded for a whole TTL (etcd unreachable). Each
/// renewal moves the validity (`Member::validity`) on from the moment it was asked.
pub(crate) async fn keep_alive(
    c: Client,
    lease: i64,
    ttl: i64,
    (live, valid): (Arc<AtomicBool>, Arc<AtomicU64>),
    node: String,
) {
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(100));
    let mut last_ok = tokio::time::Instant::now();
    let mut stream = None;
    let lost = || {
        valid.store(0, Ordering::Release);
        live.store(false, Ordering::Release);
    };
    loop {
        if stream.is_none() {
            stream = tokio::time::timeout(period, c.lease_keep_alive(lease))
                .await
                .ok()
                .and_then(|r| r.ok());
        }
        let mut renewed = false;
        if let Some(keeper) = stream.as_mut() {
            let sent = boottime_ns();
            match tokio::time::timeout(period, keeper.renew()).await {
                Ok(Ok(granted)) if granted > 0 => {
                    renewed = true;
                    let until = sent + granted as u64 * 1_000_000_000 - validity_guard(ttl);
                    valid.fetch_max(until, Ordering::AcqRel);
                }
                Ok(Ok(_)) => {
                    tracing::warn!(node, lease, "etcd lease expired");
                    lost();
                    return;
                }
                _ => stream = None, // a new stream next time
            }
        }
        if renewed {
            last_ok = tokio::time::Instant::now();
        } else if last_ok.elapsed() >= Duration::from_secs(ttl as u64) {
            tracing::warn!(node, lease, "etcd unreachable for a whole lease TTL");
            lost();
            return;
        }
        tokio::time::sleep(period).await;
    }
}
