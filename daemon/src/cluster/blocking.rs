//! Waiting for the cluster runtime from the store's threads.

use std::future::Future;

/// Runs `f` on the runtime of `rt` and waits for it: driven on this thread when it is not one
/// of a runtime's; from a runtime's thread, on a worker while this thread waits. Never under
/// the store's lock (checked in debug builds): what it waits for may wait for etcd.
pub(super) fn wait_on<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    f: impl Future<Output = T> + Send + 'static,
) -> T {
    crate::store::assert_unlocked("a wait on the cluster runtime");
    if tokio::runtime::Handle::try_current().is_err() {
        // Not a runtime's thread (a client's connection, the applier): drive the future
        // here, with no hop to a worker and back.
        return rt.block_on(f);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv().expect("the cluster runtime is running")
}
