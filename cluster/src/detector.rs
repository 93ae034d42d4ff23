//! Another host's lease revoked by this one once its renewals stopped.
//!
//! etcd releases an expired lease from its leader's lessor, which looks for expired leases
//! every 500 ms and, when its server does not take the revocation at once (a member catching
//! up after a partition keeps it busy), looks at that lease again only after 3 s
//! (`expiredLeaseRetryInterval`): the other hosts then wait up to 4 s past the TTL for a
//! cut-off host's regions (doc/RELIABILITY.md, seeds 506, 1087, 1268). So each host follows
//! the others' beats (`beats/<node>`, rewritten at each of their renewals:
//! [`crate::lease::beat`]) and ends a lease whose beat stayed unchanged past its TTL.
//!
//! Why that is safe: a host counts a renewal only once its beat is written, and then holds
//! its regions at most until the renewal's request time plus the TTL etcd granted (the
//! value of the beat). That request came before the beat was committed, which came before
//! this host saw it; so once this host has seen the same beat for longer than that TTL (and
//! a margin for the two clocks' rates), the other host's hold is over. The deletion of the
//! beat compares its revision: a beat written meanwhile makes it fail, and after it the
//! other host's beats fail (they require the key to be its lease's), so it learns that its
//! lease is lost and joins anew. Only then is the lease revoked, its keys (regions, holds,
//! reservations) going with it as at its expiry. A host that writes no beats (an older
//! version) is never acted on.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Result;
use crate::etcd::{self, Client, Compare, EventType, KeyValue, Op, Range, Txn};
use crate::keys::Keys;

/// How long past a beat's TTL this host waits: the clocks' rates, with room to spare.
const MARGIN: Duration = Duration::from_millis(300);

/// How often the beats are looked at.
const TICK: Duration = Duration::from_millis(100);

/// The last beat seen of one host.
struct Beat {
    revision: i64,
    lease: i64,
    ttl: Duration,
    /// When this host saw it (after its commit).
    seen: Instant,
}

/// Follows the beats of every host but `me` and ends the leases of those that stopped, for
/// as long as it runs (the member aborts it when it leaves).
pub(crate) async fn watch_beats(client: Client, keys: Keys, me: String) {
    let mut revoking = Vec::new();
    loop {
        if let Err(e) = follow(&client, &keys, &me, &mut revoking).await {
            tracing::debug!(node = me, error = %e, "following the beats failed");
        }
        tokio::time::sleep(TICK).await;
    }
}

/// One read of every beat and the watch from it, until the watch ends or fails.
async fn follow(client: &Client, keys: &Keys, me: &str, revoking: &mut Vec<i64>) -> Result<()> {
    let prefix = keys.beats();
    let r = client.get(prefix.clone(), Range::PREFIX).await?;
    let mut beats = HashMap::new();
    let now = Instant::now();
    for kv in &r.kvs {
        note(&mut beats, &prefix, me, kv, true, now);
    }
    let from = r.header.map_or(0, |h| h.revision) + 1;
    let mut stream = client
        .watch(prefix.clone(), Range::PREFIX, from, false)
        .await?;
    let mut tick = tokio::time::interval(TICK);
    loop {
        tokio::select! {
            m = stream.message() => {
                let Some(resp) = m? else { return Ok(()) };
                if resp.canceled {
                    return Ok(());
                }
                let now = Instant::now();
                for ev in &resp.events {
                    if let Some(kv) = ev.kv.as_ref() {
                        note(&mut beats, &prefix, me, kv, ev.r#type() == EventType::Put, now);
                    }
                }
            }
            _ = tick.tick() => {
                end_silent(client, keys, &mut beats, revoking).await;
            }
        }
    }
}

/// Records a beat (`put`) or its deletion.
fn note(
    beats: &mut HashMap<String, Beat>,
    prefix: &str,
    me: &str,
    kv: &KeyValue,
    put: bool,
    now: Instant,
) {
    let Some(node) = std::str::from_utf8(&kv.key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .filter(|n| *n != me)
    else {
        return;
    };
    let ttl = std::str::from_utf8(&kv.value)
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    match ttl {
        Some(ttl) if put => {
            beats.insert(
                node.to_owned(),
                Beat {
                    revision: kv.mod_revision,
                    lease: kv.lease,
                    ttl: Duration::from_secs(ttl),
                    seen: now,
                },
            );
        }
        _ => {
            beats.remove(node);
        }
    }
}

/// Deletes the beat of every host silent past its TTL (if still unchanged), then revokes its
/// lease; revocations that failed before are tried again.
async fn end_silent(
    client: &Client,
    keys: &Keys,
    beats: &mut HashMap<String, Beat>,
    revoking: &mut Vec<i64>,
) {
    let silent: Vec<String> = beats
        .iter()
        .filter(|(_, b)| b.seen.elapsed() > b.ttl + MARGIN)
        .map(|(n, _)| n.clone())
        .collect();
    for node in silent {
        let b = &beats[&node];
        let key = keys.beat(&node);
        let txn = Txn::new()
            .when([Compare::modified(key.clone(), b.revision)])
            .and_then([Op::delete(key)]);
        match client.txn(txn).await {
            Ok(r) if r.succeeded() => {
                tracing::warn!(
                    host = node,
                    lease = b.lease,
                    silent_ms = b.seen.elapsed().as_millis() as u64,
                    "a host's lease renewals stopped: its lease is revoked"
                );
                revoking.push(b.lease);
                beats.remove(&node);
            }
            // Beaten meanwhile: the watch brings the new beat; until then, wait again.
            Ok(_) => beats.get_mut(&node).expect("listed").seen = Instant::now(),
            Err(e) => tracing::debug!(host = node, error = %e, "a silent host's beat not deleted"),
        }
    }
    let mut left = Vec::new();
    for lease in revoking.drain(..) {
        match client.lease_revoke(lease).await {
            Ok(()) => {}
            Err(etcd::Error::Status(s)) if s.code() == tonic::Code::NotFound => {}
            Err(e) => {
                tracing::debug!(lease, error = %e, "a silent host's lease not revoked yet");
                left.push(lease);
            }
        }
    }
    *revoking = left;
}
