//! The regions this host gave back and etcd has not released yet, and the turn that their
//! releases and this host's claims take at etcd (`regions`).

use std::collections::HashMap;

/// A region being given back (`EtcdAuthority::give_back`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Release {
    pub(super) len: u64,
    /// Its claim's answer was lost: this host's requests on their way are fenced first.
    pub(super) unanswered: bool,
}

/// The seam before a region's release goes to etcd (tests; feature `seams`): when one is
/// set, each attempt takes one of its permits first, in its turn at etcd.
#[cfg(feature = "seams")]
pub type ReleaseGate = super::seams::Gate;

/// Regions given back here whose claims etcd has not deleted yet, and the turn that their
/// releases and this host's claims take at etcd.
#[derive(Default)]
pub(super) struct Releasing {
    /// Offset -> the release. A plain lock, never held across a wait: the store gives
    /// regions back under its own lock, which no etcd request may hold (seed 1873: a release
    /// stuck at an etcd member cut off held this map, and the store waited 2 s for it).
    pub(super) pending: parking_lot::Mutex<HashMap<u64, Release>>,
    /// Held across the etcd requests of a release and of a claim: a claim over a range
    /// finishes the release pending over it first, and a release never deletes a claim made
    /// after it (it checks, in its turn, that it is still pending).
    pub(super) turn: tokio::sync::Mutex<()>,
    /// Regions whose release was sent and not answered since the last fence: it may land
    /// yet, and a claim of the region made meanwhile fences first (the release compares the
    /// fence, so it then deletes nothing).
    pub(super) late: parking_lot::Mutex<HashMap<u64, u64>>,
    #[cfg(feature = "seams")]
    pub(super) gate: parking_lot::RwLock<Option<ReleaseGate>>,
}

impl Releasing {
    /// Whether `this` is still the release pending at `offset`.
    pub(super) fn is_pending(&self, offset: u64, this: Release) -> bool {
        self.pending.lock().get(&offset) == Some(&this)
    }

    /// Done: `offset`'s release, if `this` is still the one pending there.
    pub(super) fn done(&self, offset: u64, this: Release) {
        let mut pending = self.pending.lock();
        if pending.get(&offset) == Some(&this) {
            pending.remove(&offset);
        }
    }

    /// Whether a release of a region overlapping `[offset, offset + len)` may land late.
    pub(super) fn late_over(&self, offset: u64, len: u64) -> bool {
        let late = self.late.lock();
        late.iter()
            .any(|(&o, &l)| o < offset + len && offset < o + l)
    }

    /// Waits for a permit of the seam, if one is set.
    pub(super) async fn before_release(&self) {
        #[cfg(feature = "seams")]
        super::seams::through(&self.gate).await;
    }
}
