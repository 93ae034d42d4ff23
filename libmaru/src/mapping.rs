//! Mappings of pool memory handed to users.

use std::sync::Arc;

use parking_lot::Mutex;

/// A read-only mapping of a sealed entry: the pool's own pages, no copy.
///
/// Cheap to clone (shared). The bytes stay valid until the last clone is
/// dropped, even if the entry is deleted or evicted meanwhile.
#[derive(Clone)]
pub struct Mapping {
    pub(crate) inner: Arc<MapInner>,
}

pub(crate) struct MapInner {
    /// The memory: an entry's own file (memfs pools) or the whole pool, shared by every
    /// entry of it this client retrieved (raw pools).
    pub(crate) map: Arc<memmap2::Mmap>,
    /// Start of the entry inside `map` (its offset in the pool, for raw pools).
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) generation: u64,
    /// The pool it lives in and its offset there (raw pools; 0 for memfs entries).
    pub(crate) pool: u32,
    pub(crate) offset: u64,
    /// Raw pools: where to queue the lease release when the last user drops.
    pub(crate) release: Option<Arc<Mutex<Vec<u64>>>>,
}

impl Drop for MapInner {
    fn drop(&mut self) {
        if let Some(q) = &self.release {
            q.lock().push(self.generation);
        }
    }
}

impl Mapping {
    /// The entry's bytes.
    ///
    /// Sealed entries are immutable: the daemon never writes them, the mount
    /// refuses to open them for writing, and a writer's handles are consumed at
    /// publication. (A process that breaks the protocol by keeping a writable
    /// mapping of its own entry after publishing could still change it; it must
    /// have had write access to the namespace to create it.)
    pub fn as_slice(&self) -> &[u8] {
        &self.inner.map[self.inner.start..self.inner.start + self.inner.len]
    }

    /// Address of the first byte (for DMA registration, GPU copies...).
    pub fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// True for an empty entry.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The entry's generation (unique per sealed entry).
    pub fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// Id of the pool the entry lives in.
    pub fn pool(&self) -> u32 {
        self.inner.pool
    }

    /// Offset of the entry in its pool (raw pools; 0 for memfs entries, files of their own).
    pub fn offset(&self) -> u64 {
        self.inner.offset
    }
}

impl std::ops::Deref for Mapping {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("len", &self.inner.len)
            .field("generation", &self.inner.generation)
            .finish()
    }
}
