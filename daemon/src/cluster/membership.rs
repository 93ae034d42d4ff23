//! This host's membership: rejoining when the lease is lost (fenced off meanwhile), and the
//! hosts and their claims, for stats.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{EtcdAuthority, Lost, Name};
use crate::store::authority::Authority;

impl EtcdAuthority {
    /// Starts the tasks that keep this host a member.
    pub(super) fn start_membership(self: &Arc<Self>) {
        self.rt.spawn(keep_membership(Arc::downgrade(self)));
        self.rt.spawn(watch_hosts(Arc::downgrade(self)));
    }
}

/// Rejoins when the lease is lost, then claims this host's regions again.
async fn keep_membership(me: std::sync::Weak<EtcdAuthority>) {
    // After a failed rejoin: 50 ms, doubled after each failure up to 400 ms. Failures right
    // after a cut heals are mostly the cut's leftovers (connections the keep-alive has not
    // ended yet), gone on the next try.
    let mut pause = REJOIN_PAUSE;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(a) = me.upgrade() else { return };
        if a.member.read().await.is_live() {
            continue;
        }
        tracing::warn!(node = %a.node, "lost the cluster lease: no publication until rejoined");
        // Fenced off until the regions are claimed again and the applier has read every
        // entry afresh after the rejoin (see `EtcdAuthority::fence`).
        a.rejoining.store(true, Ordering::Release);
        let mut m = a.member.write().await;
        match m.rejoin().await {
            Err(e) => {
                tracing::warn!(node = %a.node, "rejoining: {e}");
                drop(m);
                drop(a);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(400));
                continue;
            }
            // etcd still held the lease (an election renewed it): its claims, holds, pins
            // and reservations are all there.
            Ok(maru_cluster::Rejoined::Kept) => {
                pause = REJOIN_PAUSE;
                rejoined(&a);
                tracing::info!(node = %a.node, lease = m.lease(), "kept the cluster lease");
                continue;
            }
            Ok(maru_cluster::Rejoined::Anew) => {}
        }
        pause = REJOIN_PAUSE;
        // A region claimed here when the rejoin began may leave meanwhile: a claim of it on
        // its way across the cut, refused or failed, drops it (under `lost`'s lock, which this
        // takes to look).
        let held = |off: u64| {
            let _lost = a.lost.lock();
            a.local.regions(&a.pool).iter().any(|&(o, _)| o == off)
        };
        for (off, len) in a.local.regions(&a.pool) {
            match m.claim_again(off, len).await {
                Ok(true) if !held(off) => {
                    // Gone from here while claimed again: given back, or etcd would keep it
                    // for this host as long as it lives.
                    if let Err(e) = m.release(off, len).await {
                        tracing::warn!(off, len, "giving back a region claimed again: {e}");
                    }
                }
                Ok(true) => {}
                Ok(false) => {
                    let mut lost = a.lost.lock();
                    if a.local.regions(&a.pool).iter().any(|&(o, _)| o == off) {
                        tracing::error!(
                            off,
                            len,
                            "a region of this host was claimed by another while this one was cut \
                             off; nothing more is placed there, and what was written there is \
                             not published"
                        );
                        lost.insert(off, Lost::Taken);
                    }
                }
                // Not known to be this host's: as one another host's entry lives in, nothing
                // more is placed there and nothing written there is published; the claim,
                // if it landed, is given back once the region is freed here. Kept as it was,
                // the region went on taking this host's allocations unclaimed, and another
                // host could claim and carve it too.
                Err(e) => {
                    let mut lost = a.lost.lock();
                    if a.local.regions(&a.pool).iter().any(|&(o, _)| o == off) {
                        tracing::error!(
                            off,
                            len,
                            "claiming a region again failed ({e}): nothing more is placed \
                             there, and what was written there is not published"
                        );
                        lost.entry(off).or_insert(Lost::Occupied);
                    }
                }
            }
        }
        // What the old lease held is gone: the holds are recorded again (in the background),
        // the mount writers' reservations taken again where no one took the name meanwhile.
        for h in a.readers.lock().holds.values_mut() {
            (h.recorded, h.unanswered) = (false, false);
        }
        let pinned = a.client_pins.here();
        if let Err(e) = m.pin_for_clients(&pinned, true).await {
            tracing::warn!("pinning again what clients here pin: {e}");
        }
        let names: Vec<Name> = a.reserved.lock().iter().cloned().collect();
        for (ns, key) in names {
            let r = m.reserve(&ns, &key).await;
            if r.as_ref()
                .is_err_and(|e| matches!(e, maru_cluster::Error::Etcd(_)) && !e.never_sent())
            {
                // It may have landed all the same.
                a.give_back_reservation((ns.clone(), key.clone()), true);
            }
            if !matches!(r, Ok(None)) {
                tracing::warn!(
                    ns,
                    key,
                    "a name reserved before the cut is taken: its writer's entry will not be published"
                );
                a.changing.settle(&ns, &key);
                a.reserved.lock().remove(&(ns, key));
            }
        }
        rejoined(&a);
        tracing::info!(node = %a.node, lease = m.lease(), "rejoined the cluster");
    }
}

/// The first pause after a failed rejoin.
const REJOIN_PAUSE: Duration = Duration::from_millis(50);

/// A rejoin is done: the host stays fenced off until the applier has read every entry
/// afresh, begun after this moment. A read made before, while the host was still cut off
/// (its lease gone, the rejoin failing), misses what was removed after it: that host served
/// entries deleted meanwhile elsewhere, whose extents were carved again (seed 74).
fn rejoined(a: &EtcdAuthority) {
    a.rejoins.send_modify(|n| *n += 1);
    a.rejoining.store(false, Ordering::Release);
}

impl EtcdAuthority {
    /// The hosts (as last refreshed) with the entries each published that this host
    /// knows, and the publishers gone whose entries stay, for stats.
    pub(super) fn hosts_info(&self) -> Vec<maru::proto::HostInfo> {
        let now = std::time::Instant::now();
        let mut by_node: HashMap<&str, u64> = HashMap::new();
        let remote = self.remote.lock();
        for (node, _) in remote.values() {
            *by_node.entry(node).or_default() += 1;
        }
        let mut hosts = self.hosts.lock().clone();
        for h in &mut hosts {
            h.entries = by_node.remove(h.node.as_str()).unwrap_or(0);
        }
        // Publishers that are gone: their entries stay, under their name.
        let mut gone: Vec<maru::proto::HostInfo> = by_node
            .into_iter()
            .map(|(node, entries)| maru::proto::HostInfo {
                node: node.to_owned(),
                entries,
                gone: true,
                orphaned: self.orphans.orphaned(node, now),
                ..Default::default()
            })
            .collect();
        gone.sort_by(|x, y| x.node.cmp(&y.node));
        hosts.extend(gone);
        hosts
    }
}

/// Refreshes the hosts and their claims every second, for stats, and since when the
/// publishers of the entries served here have been gone (their entries become orphans).
async fn watch_hosts(me: std::sync::Weak<EtcdAuthority>) {
    loop {
        let Some(a) = me.upgrade() else { return };
        let seen = {
            let m = a.member.read().await;
            match (m.nodes().await, m.regions().await) {
                (Ok(nodes), Ok(regions)) => Some((nodes, regions)),
                _ => None,
            }
        };
        if let Some((nodes, regions)) = seen {
            let live: std::collections::HashSet<&str> =
                nodes.iter().map(|n| n.node.as_str()).collect();
            let publishers: std::collections::HashSet<String> =
                a.remote.lock().values().map(|(p, _)| p.clone()).collect();
            a.orphans.seen(
                &live,
                publishers.iter().map(String::as_str),
                std::time::Instant::now(),
            );
            let mut claimed: HashMap<String, u64> = HashMap::new();
            for holder in regions.values() {
                *claimed.entry(holder.clone()).or_default() += maru_cluster::UNIT;
            }
            let mut hosts: Vec<maru::proto::HostInfo> = nodes
                .into_iter()
                .map(|n| maru::proto::HostInfo {
                    claimed: claimed.get(&n.node).copied().unwrap_or(0),
                    entries: 0, // counted when asked (cluster())
                    node: n.node,
                    address: n.address,
                    pid: n.pid,
                    gone: false,
                    orphaned: false,
                })
                .collect();
            hosts.sort_by(|x, y| x.node.cmp(&y.node));
            *a.hosts.lock() = hosts;
        }
        drop(a);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
