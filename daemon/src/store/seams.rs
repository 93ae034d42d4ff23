//! The store's crash- and fault-injection seams, for the daemon's own tests: built with the
//! crate's feature `seams` only (marud has none of them; without it a write through the mount
//! asks no fault).

#[cfg(feature = "seams")]
use super::DataFault;
use super::Store;
#[cfg(feature = "seams")]
use super::pools::Seams;

impl Store {
    /// Replaces the log sink of raw pool `pool` (crash-injection tests).
    #[cfg(feature = "seams")]
    pub fn set_log_sink(&self, pool: u32, sink: Box<dyn crate::wal::LogSink>) {
        if let Seams::Raw(w) = self.lock().pools[pool as usize].pool.seams() {
            *w = Some(crate::wal::Wal::new(sink));
        }
    }

    /// Installs the crash-injection seam of a memfs pool's metadata steps (tests).
    #[cfg(feature = "seams")]
    pub fn set_memfs_gate(&self, pool: u32, gate: Option<crate::pool::memfs::MetaGate>) {
        if let Seams::Memfs(m) = self.lock().pools[pool as usize].pool.seams() {
            m.set_gate(gate);
        }
    }

    /// Installs the fault-injection seam of writes through the mount (tests).
    #[cfg(feature = "seams")]
    pub fn set_data_fault(&self, f: Option<DataFault>) {
        *self.data_fault.write() = f;
    }

    /// The errno a write through the mount into `ino` fails with, by the fault-injection seam.
    #[cfg(feature = "seams")]
    pub(super) fn data_fault(&self, ino: u64) -> Option<i32> {
        self.data_fault.read().as_ref().and_then(|f| f(ino))
    }

    /// Installs the seam between a shared authority's answer and the store's next step
    /// (tests; see [`super::AskGate`]).
    #[cfg(feature = "seams")]
    pub fn set_ask_gate(&self, gate: Option<super::AskGate>) {
        *self.ask_gate.write() = gate;
    }

    /// Passes the authority's answer `step` for `ns/key` through the seam (tests).
    #[cfg(feature = "seams")]
    pub(super) fn ask_gate(&self, step: &str, ns: &str, key: &str) {
        if let Some(g) = self.ask_gate.read().as_ref() {
            g(step, ns, key);
        }
    }

    /// No seam: built with feature `seams` only.
    #[cfg(not(feature = "seams"))]
    pub(super) fn ask_gate(&self, _step: &str, _ns: &str, _key: &str) {}

    /// No fault: the seam is built with feature `seams` only.
    #[cfg(not(feature = "seams"))]
    pub(super) fn data_fault(&self, _ino: u64) -> Option<i32> {
        None
    }
}
