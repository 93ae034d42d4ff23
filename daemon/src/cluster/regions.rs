//! Regions given back to the cluster: a claim's release, tried in the background until etcd
//! takes it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use maru::{Error, Result};

#[cfg(feature = "seams")]
use super::ClaimGate;
use super::releasing::Release;
#[cfg(feature = "seams")]
use super::releasing::ReleaseGate;
use super::{EtcdAuthority, Lost, unavailable};
use crate::store::authority::Authority;

/// How a fresh claim went at etcd, and what the view found in its range.
#[derive(Debug)]
enum Claimed {
    /// Claimed, and nothing of another host's is in it.
    Yes,
    /// Another host holds a unit of it, maps an extent there, or a removal there is not
    /// yet acknowledged by every live host.
    Refused,
    /// Claimed, but another host's entry (offset, length) lives there: its last holder
    /// published it before it lost the region.
    Occupied((u64, u64)),
    /// Claimed, but the entry watch did not deliver the claim's revision in time.
    Blind,
}

impl EtcdAuthority {
    /// [`Authority::claim_region`](crate::store::authority::Authority::claim_region) on the
    /// shared pool: claimed in etcd (after the releases of this host's pending over it).
    pub(super) fn claim_shared(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.local.claim_region(pool, offset, len)?;
        if pool != self.pool {
            return Ok(());
        }
        crate::store::assert_unlocked("a region's claim at etcd");
        self.claim_gate(offset);
        let (m, releasing, view) = (self.member(), self.releasing.clone(), self.view.clone());
        let r = self.run(async move {
            let turn = releasing.turn.lock().await;
            let m = m.read().await;
            // A release of this host's over the range not taken yet goes first (after a
            // fence, for a claim whose answer was lost: see `give_back`).
            let before: Vec<(u64, Release)> = releasing
                .pending
                .lock()
                .iter()
                .filter(|&(&o, r)| o < offset + len && offset < o + r.len)
                .map(|(&o, r)| (o, *r))
                .collect();
            if releasing.late_over(offset, len) {
                // A release of the range sent before may land yet: fenced, it deletes nothing.
                m.fence_publications().await?;
                releasing.late.lock().clear();
            }
            for (o, r) in before {
                if r.unanswered {
                    m.fence_publications().await?;
                }
                m.release(o, r.len).await?;
                releasing.done(o, r);
            }
            let Some(revision) = m.claim(offset, len).await? else {
                return Ok(Claimed::Refused);
            };
            let patience = m.ttl();
            drop((m, turn));
            // Whatever the range's last holder published there precedes the claim: once the
            // watch has delivered the claim's revision, every such entry is known here (the
            // view has it even while the store holds it back: seed 1462).
            if !view.wait_seen(revision, patience).await {
                return Ok(Claimed::Blind);
            }
            Ok(match view.other_in(offset, len) {
                Some(e) => Claimed::Occupied(e),
                None => Claimed::Yes,
            })
        });
        tracing::debug!(offset, len, ?r, "claim");
        // Refused or failed, the region leaves this host, and is given back in etcd whatever
        // the answer: a rejoin while the claim was on its way claims the regions held here
        // again, this one included, for this host under its new lease (a release of a unit
        // another host holds changes nothing). Left, such a claim would keep the region from
        // every host for as long as this one lives (seed 5 of the CI's partitions).
        let e = match r {
            // A rejoin while the claim waited for the watch marked the region lost here:
            // nothing goes there (claimed again under the new lease but not known to be free,
            // the claim is given back).
            Ok(Claimed::Yes) if self.lost.lock().contains_key(&offset) => {
                if self.lost.lock().get(&offset) == Some(&Lost::Occupied) {
                    self.give_back(offset, len, false);
                }
                Error::Busy(format!(
                    "region {offset:#x}+{len:#x} was lost to another host while it was claimed"
                ))
            }
            Ok(Claimed::Yes) => return Ok(()),
            Ok(Claimed::Refused) => {
                self.give_back(offset, len, false);
                Error::Busy(format!(
                    "region {offset:#x}+{len:#x} is claimed by another host"
                ))
            }
            Ok(Claimed::Occupied((o, l))) => {
                tracing::info!(
                    offset,
                    len,
                    entry = o,
                    "a region claimed holds another host's entry: given back"
                );
                self.give_back(offset, len, false);
                Error::Busy(format!(
                    "region {offset:#x}+{len:#x} holds another host's entry ({o:#x}+{l:#x})"
                ))
            }
            Ok(Claimed::Blind) => {
                self.give_back(offset, len, false);
                unavailable(
                    "this host's view of the cluster's entries lags etcd: no region is \
                     claimed until it has caught up",
                )
            }
            Err(maru_cluster::Error::LeaseLost(_)) => {
                self.give_back(offset, len, false);
                unavailable("this host lost its lease; no region until it has rejoined")
            }
            Err(e) => {
                // Unanswered, the claim itself may have landed, or land later: fenced first.
                self.give_back(offset, len, !e.never_sent());
                unavailable(e)
            }
        };
        self.unclaim(pool, offset);
        Err(e)
    }

    /// A claim of the region at `offset` did not hold: the region leaves this host, and with
    /// it any mark that it was lost. (A claim on its way across a cut, its region claimed here
    /// already, is found taken by the rejoin and marked lost; left marked once the region has
    /// gone, the mark would keep the region from etcd when this host next claims it and frees
    /// it, its release skipped as another's.) Under `lost`'s lock: the rejoin marks a region
    /// only while it is claimed here.
    fn unclaim(&self, pool: &str, offset: u64) {
        let mut lost = self.lost.lock();
        lost.remove(&offset);
        self.local.release_region(pool, offset);
    }

    /// Marks lost every region of this host's where the view holds another host's entry:
    /// one claimed again after a rejoin, that another host claimed, wrote and lost while
    /// this one was cut off. Nothing more is placed there, and nothing written there is
    /// published.
    pub(super) fn lose_occupied(&self) {
        for (off, len) in self.local.regions(&self.pool) {
            let Some((o, l)) = self.view.other_in(off, len) else {
                continue;
            };
            let mut lost = self.lost.lock();
            if let std::collections::hash_map::Entry::Vacant(v) = lost.entry(off) {
                v.insert(Lost::Occupied);
                tracing::error!(
                    off,
                    len,
                    entry = o,
                    entry_len = l,
                    "another host's entry lives in a region of this host's (claimed while this \
                     one was cut off): nothing more is placed there, and what was written \
                     there is not published"
                );
            }
        }
    }

    /// Whether this host is rejoining the cluster, or rejoined (after a lost lease, not its
    /// first join: a restart's recovery publishes before its first read) and has not read
    /// every entry since.
    pub(super) fn catching_up(&self) -> bool {
        let rejoins = *self.rejoins.borrow();
        self.rejoining.load(Ordering::Acquire)
            || (rejoins > 1 && self.caught_up.load(Ordering::Acquire) < rejoins)
    }

    /// Whether the extent at `offset` of the shared pool is in a region of this host's
    /// marked lost.
    pub(super) fn in_lost_region(&self, offset: u64) -> bool {
        let lost = self.lost.lock();
        !lost.is_empty()
            && self
                .local
                .regions(&self.pool)
                .iter()
                .any(|&(o, l)| lost.contains_key(&o) && (o..o + l).contains(&offset))
    }

    /// Holds back (or lets go of) what the entry watch delivers, as a watch stuck on an etcd
    /// member cut off from the others does (tests).
    #[cfg(feature = "seams")]
    pub fn hold_watch(&self, held: bool) {
        self.view.hold(held);
    }

    /// Installs the seam run before a claim of a fresh region (its offset) goes to etcd, the
    /// region already this host's here (tests).
    #[cfg(feature = "seams")]
    pub fn set_claim_gate(&self, gate: Option<ClaimGate>) {
        *self.claim_gate.write() = gate;
    }

    /// Installs the seam before a region's release goes to etcd (tests).
    #[cfg(feature = "seams")]
    pub fn set_release_gate(&self, gate: Option<ReleaseGate>) {
        *self.releasing.gate.write() = gate;
    }

    /// Passes a claim of the region at `offset` through the seam (tests).
    #[cfg(feature = "seams")]
    fn claim_gate(&self, offset: u64) {
        if let Some(g) = self.claim_gate.read().as_ref() {
            g(offset);
        }
    }

    /// No seam: built with feature `seams` only.
    #[cfg(not(feature = "seams"))]
    fn claim_gate(&self, _offset: u64) {}

    /// [`Authority::claim_again`](crate::store::authority::Authority::claim_again) on the
    /// shared pool.
    pub(super) fn claim_again_shared(&self, pool: &str, offset: u64, len: u64) -> Result<()> {
        self.local.claim_region(pool, offset, len)?;
        if pool != self.pool {
            return Ok(());
        }
        // Refused, the region is another host's for a moment only: this host's entries there
        // are in etcd (the start's recovery published them first), so another host's fresh
        // claim finds one of them and gives the region back, and the claim of a host cut off
        // goes with its lease. Asked again until then, for up to twice the lease's TTL: a
        // refusal fails the start.
        let m = self.member();
        let r = self.run(async move {
            let deadline = tokio::time::Instant::now() + 2 * m.read().await.ttl();
            loop {
                let r = m.read().await.claim_again(offset, len).await;
                match r {
                    Ok(false) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    r => return r,
                }
            }
        });
        match r {
            Ok(true) => Ok(()),
            r => {
                self.unclaim(pool, offset);
                Err(match r {
                    Ok(_) => Error::Busy(format!(
                        "region {offset:#x}+{len:#x} is claimed by another host"
                    )),
                    Err(e) => {
                        // As for a claim: it may have landed unanswered.
                        if !e.never_sent() {
                            self.give_back(offset, len, true);
                        }
                        unavailable(e)
                    }
                })
            }
        }
    }

    /// [`Authority::release_region`](crate::store::authority::Authority::release_region) on
    /// the shared pool: given back in the background.
    pub(super) fn release_shared(&self, pool: &str, offset: u64) {
        let len = self
            .local
            .regions(pool)
            .into_iter()
            .find(|&(o, _)| o == offset)
            .map(|(_, l)| l);
        self.local.release_region(pool, offset);
        if self.lost.lock().remove(&offset) == Some(Lost::Taken) {
            return; // another host's now: nothing of it to give back
        }
        if let (Some(len), true) = (len, pool == self.pool) {
            self.give_back(offset, len, false);
        }
    }

    /// Releases this host's claim of `[offset, offset + len)` in etcd, in the background, and
    /// again every half second while etcd fails it (left, the claim would keep the region
    /// from every host for as long as this one lives); not once the lease it was made under
    /// is gone (the claim went with it), nor once a claim over it finished it. Also for a
    /// claim whose answer was lost (`unanswered`): it may have landed, or land later (the
    /// network queued it), so this host's publications and claims on their way are fenced
    /// first (`Member::fence_publications`): none lands after.
    pub(super) fn give_back(&self, offset: u64, len: u64, unanswered: bool) {
        let (m, releasing) = (self.member(), self.releasing.clone());
        // Pending before this returns: a claim over the range made next finishes it first
        // (it never releases a claim made after it). Recorded without waiting: this runs
        // under the store's lock.
        let this = Release { len, unanswered };
        releasing.pending.lock().insert(offset, this);
        self.rt.spawn(async move {
            let lease = m.read().await.lease();
            let mut fence_first = unanswered;
            for attempt in 0u32.. {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                let _turn = releasing.turn.lock().await;
                if !releasing.is_pending(offset, this) {
                    return; // a claim over it finished it, or a newer release took its place
                }
                releasing.before_release().await;
                let m = m.read().await;
                // A new lease: the claim went with the old one.
                let r = if m.lease() == lease {
                    let fenced = if fence_first {
                        m.fence_publications().await.inspect(|()| {
                            releasing.late.lock().clear();
                        })
                    } else {
                        Ok(())
                    };
                    match fenced {
                        Ok(()) => m.release(offset, len).await,
                        Err(e) => Err(e),
                    }
                } else {
                    Ok(())
                };
                if let Err(e) = &r
                    && !e.never_sent()
                {
                    // Unanswered, it may land yet: the next attempt, and a claim of the
                    // region meanwhile, fence first.
                    releasing.late.lock().insert(offset, len);
                    fence_first = true;
                }
                match r {
                    Ok(()) => {
                        releasing.done(offset, this);
                        return;
                    }
                    Err(e) if attempt == 0 => tracing::warn!(
                        offset,
                        len,
                        "releasing a region in the cluster: {e}; trying again until etcd takes it"
                    ),
                    Err(_) => {}
                }
            }
        });
    }
}
