//! The seams of the cluster mode's tests (feature `seams`): semaphores that hold a step
//! until the test gives a permit.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// A seam's semaphore: each pass through it takes a permit.
pub type Gate = Arc<Semaphore>;

/// Takes a permit of the seam's semaphore, if one is set.
pub(super) async fn through(seam: &parking_lot::RwLock<Option<Gate>>) {
    let gate = seam.read().clone();
    if let Some(g) = gate
        && let Ok(permit) = g.acquire().await
    {
        permit.forget();
    }
}
