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
//! reservations) going with it as at its expiry; every host that sees a beat deleted revokes
//! its lease (the deleter's answer may be lost). A host that writes no beats (an older
//! version) is never acted on.
//!
//! An election of etcd's leader stops every host's beats for a second or two (no write goes
//! through meanwhile), as it stops their renewals, and the hosts that fenced themselves off
//! meanwhile take a while to renew again; etcd's new leader renews every lease by its TTL,
//! and so does the detector: a beat's TTL counts again from when it learns of a new raft term
//! (a healthy host given half a second was revoked after etcd's leader was cut off, seed
//! 1423). Right before it acts it reads the term again.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Result;
use crate::etcd::{self, Client, Compare, EventType, KeyValue, Op, Range, Txn};
use crate::keys::Keys;

/// How long past a beat's TTL this host waits, at least: the clocks' rates, with room to
/// spare (a 200th of the TTL beyond 60 s).
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

impl Beat {
    /// When this host may end the lease, if the beat stays as it is: its TTL (and the
    /// margin) after it was seen, or after the last new term if that came later.
    fn deadline(&self, term_at: Instant) -> Instant {
        self.seen.max(term_at) + self.ttl + MARGIN.max(self.ttl / 200)
    }
}

/// What the detector knows; kept across its watch's restarts.
struct Detector {
    client: Client,
    keys: Keys,
    prefix: String,
    me: String,
    beats: HashMap<String, Beat>,
    /// The newest raft term seen, and when it was first seen.
    term: (u64, Instant),
    /// Leases whose beat is gone and which are not known revoked yet.
    revoking: Vec<i64>,
}

/// Follows the beats of every host but `me` and ends the leases of those that stopped, for
/// as long as it runs (the member aborts it when it leaves).
pub(crate) async fn watch_beats(client: Client, keys: Keys, me: String) {
    let mut d = Detector {
        prefix: keys.beats(),
        client,
        keys,
        me,
        beats: HashMap::new(),
        term: (0, Instant::now()),
        revoking: Vec::new(),
    };
    loop {
        if let Err(e) = d.follow().await {
            tracing::debug!(node = d.me, error = %e, "following the beats failed");
        }
        tokio::time::sleep(TICK).await;
    }
}

impl Detector {
    /// Notes raft term `term` (0: unknown).
    fn saw_term(&mut self, term: u64) {
        if term > self.term.0 {
            self.term = (term, Instant::now());
        }
    }

    /// One read of every beat and the watch from it, until the watch ends or fails. A beat
    /// seen before at the same revision keeps the moment it was first seen.
    async fn follow(&mut self) -> Result<()> {
        let r = self.client.get(self.prefix.clone(), Range::PREFIX).await?;
        self.saw_term(r.header.map_or(0, |h| h.raft_term));
        let now = Instant::now();
        let mut known = std::mem::take(&mut self.beats);
        for kv in &r.kvs {
            match self.node_of(&kv.key).and_then(|n| known.remove_entry(n)) {
                Some((n, b)) if b.revision == kv.mod_revision => {
                    self.beats.insert(n, b);
                }
                _ => self.note(kv, now),
            }
        }
        let from = r.header.map_or(0, |h| h.revision) + 1;
        let mut stream = self
            .client
            .watch(self.prefix.clone(), Range::PREFIX, from, true)
            .await?;
        let mut tick = tokio::time::interval(TICK);
        loop {
            tokio::select! {
                m = stream.message() => {
                    let Some(resp) = m? else { return Ok(()) };
                    if resp.canceled {
                        return Ok(());
                    }
                    self.saw_term(resp.header.map_or(0, |h| h.raft_term));
                    let now = Instant::now();
                    for ev in &resp.events {
                        match (ev.r#type(), ev.kv.as_ref()) {
                            (EventType::Put, Some(kv)) => self.note(kv, now),
                            (_, Some(kv)) => self.gone(kv, ev.prev_kv.as_ref()),
                            _ => {}
                        }
                    }
                }
                _ = tick.tick() => self.end_silent().await,
            }
        }
    }

    /// The host a beat's key names, unless it is this one.
    fn node_of<'k>(&self, key: &'k [u8]) -> Option<&'k str> {
        std::str::from_utf8(key)
            .ok()
            .and_then(|k| k.strip_prefix(self.prefix.as_str()))
            .filter(|n| *n != self.me)
    }

    /// Records a beat.
    fn note(&mut self, kv: &KeyValue, now: Instant) {
        let Some(node) = self.node_of(&kv.key).map(str::to_owned) else {
            return;
        };
        let ttl = std::str::from_utf8(&kv.value)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&t| t > 0);
        let Some(ttl) = ttl else {
            self.beats.remove(&node);
            return;
        };
        let beat = Beat {
            revision: kv.mod_revision,
            lease: kv.lease,
            ttl: Duration::from_secs(ttl),
            seen: now,
        };
        self.beats.insert(node, beat);
    }

    /// A beat deleted: by a detector (whose revocation may not have come: this host revokes
    /// the lease too) or with its lease.
    fn gone(&mut self, kv: &KeyValue, prev: Option<&KeyValue>) {
        let Some(node) = self.node_of(&kv.key).map(str::to_owned) else {
            return;
        };
        self.beats.remove(&node);
        if let Some(lease) = prev.map(|p| p.lease).filter(|&l| l != 0)
            && !self.revoking.contains(&lease)
        {
            self.revoking.push(lease);
        }
    }

    /// Deletes the beat of every host silent past its deadline (if still unchanged, and no
    /// new term began), then revokes the leases whose beats are gone.
    async fn end_silent(&mut self) {
        let now = Instant::now();
        let mut silent: Vec<String> = self
            .beats
            .iter()
            .filter(|(_, b)| b.deadline(self.term.1) <= now)
            .map(|(n, _)| n.clone())
            .collect();
        if !silent.is_empty() {
            // The term right now (a linearizable read): an election since moves every
            // deadline on, and one under way (no leader) is waited out.
            match self.client.get(self.prefix.clone(), Range::KEY).await {
                Ok(r) => self.saw_term(r.header.map_or(0, |h| h.raft_term)),
                Err(_) => silent.clear(),
            }
            let now = Instant::now();
            silent.retain(|n| self.beats[n].deadline(self.term.1) <= now);
        }
        for node in silent {
            let b = &self.beats[&node];
            let key = self.keys.beat(&node);
            let txn = Txn::new()
                .when([Compare::modified(key.clone(), b.revision)])
                .and_then([Op::delete(key)]);
            match self.client.txn(txn).await {
                Ok(r) if r.succeeded() => {
                    tracing::warn!(
                        host = node,
                        lease = b.lease,
                        silent_ms = b.seen.elapsed().as_millis() as u64,
                        "a host's lease renewals stopped: its lease is revoked"
                    );
                    self.revoking.push(b.lease);
                    self.beats.remove(&node);
                }
                // Beaten meanwhile: the watch brings the new beat; until then, wait again.
                Ok(_) => self.beats.get_mut(&node).expect("listed").seen = Instant::now(),
                Err(e) => {
                    tracing::debug!(host = node, error = %e, "a silent host's beat not deleted")
                }
            }
        }
        let mut left = Vec::new();
        for lease in self.revoking.drain(..) {
            match self.client.lease_revoke(lease).await {
                Ok(()) => {}
                Err(etcd::Error::Status(s)) if s.code() == tonic::Code::NotFound => {}
                Err(e) => {
                    tracing::debug!(lease, error = %e, "a silent host's lease not revoked yet");
                    left.push(lease);
                }
            }
        }
        self.revoking = left;
    }
}
