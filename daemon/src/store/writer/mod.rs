//! A writer through the mount, from its creation to its publication (or its end): the one
//! module that changes its bookkeeping — its namespace's `writing` map, the quota bytes
//! reserved there and the count of publications on their way, and its own target,
//! commitment and reservation — in the order lock-free readers rely on: a reader of the
//! shared index looks at a namespace's pending count before its entries, so that count
//! drops only once the entry is in the index (or the writer is gone).
//!
//! The writer's bookkeeping is [`MountWrite`]'s (fields private to this module) and the
//! state transitions are in `life` (methods of the store's `State`). A writer's life: opened (its name in `writing`) → committed by a close that passed the
//! publication's checks (its bytes reserved in the namespace's quota, its publication counted
//! as pending; again with its new size after more writes) → moved by a rename, any number of
//! times → asking the authority for its publication with the store's lock let go of (in
//! cluster mode, `State::writer_asking`; an unlink or a rename waits for the answer) → its
//! bytes copied into the extent reserved for them, the lock let go of likewise (a raw pool,
//! at each commit and before the publication: `State::writer_copying`) → sealed
//! as an entry (`State::writer_sealing`, then `State::writer_sealed`) or left
//! (`State::writer_left`: unlinked, abandoned, failed or dropped).

mod life;

/// An entry being written through the mount.
#[derive(Debug)]
pub struct MountWrite {
    /// Where it will be published; `None` once unlinked or abandoned.
    target: Option<(String, String)>,
    /// The creating process: the only one that sees it before publication.
    pub tgid: i32,
    /// Bytes written (the entry's size).
    pub len: u64,
    /// A close passed the publication's checks: the name and `reserved` bytes of quota are
    /// held for it, and its publication is on its way (other processes wait for it).
    committed: bool,
    /// Quota bytes reserved in the target namespace.
    reserved: u64,
    /// The first failure (a write, a commit): it will never be published.
    pub failed: Option<i32>,
    /// Its publication is at the authority (the store's lock let go of meanwhile).
    asking: bool,
    /// Its bytes are being copied into the extent reserved for them (a raw pool; the store's
    /// lock let go of meanwhile): another copy of it, or its drop, waits.
    copying: bool,
    /// Held across a change of its file's size (`truncate`, `fallocate`), whose reservation
    /// of pages runs outside the store's lock: one such change at a time per entry.
    pub resizing: std::sync::Arc<parking_lot::Mutex<()>>,
}

impl MountWrite {
    /// A writer of process `tgid` for `ns/name`, nothing written yet.
    pub fn new(ns: &str, name: &str, tgid: i32) -> Self {
        MountWrite {
            target: Some((ns.to_owned(), name.to_owned())),
            tgid,
            len: 0,
            committed: false,
            reserved: 0,
            failed: None,
            asking: false,
            copying: false,
            resizing: Default::default(),
        }
    }

    /// Where it will be published; `None` once unlinked or abandoned.
    pub fn target(&self) -> Option<&(String, String)> {
        self.target.as_ref()
    }

    /// Whether a close committed it (its publication is on its way).
    pub fn committed(&self) -> bool {
        self.committed
    }

    /// The quota bytes reserved for it.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Whether its publication is at the authority (unlinks and renames wait for it).
    pub fn asking(&self) -> bool {
        self.asking
    }

    /// Whether its bytes are being copied into its extent (its drop waits for the copy).
    pub fn copying(&self) -> bool {
        self.copying
    }
}
