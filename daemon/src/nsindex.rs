//! The daemon's side of the shared namespace index (see `maru::index`): a memfd
//! per namespace, mapped read-write here and handed to clients read-only.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

use nix::sys::memfd::{MFdFlags, memfd_create};

use maru::index::{SlotView, Table, TableWriter, table_bytes};

/// Smallest table.
pub const MIN_SLOTS: usize = 1024;

/// One namespace's index table.
pub struct NsIndex {
    memfd: File,
    map: memmap2::MmapMut,
    nslots: usize,
    /// Slots holding a live key.
    pub live: usize,
    /// Slots holding a tombstone.
    pub tombstones: usize,
}

impl std::fmt::Debug for NsIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NsIndex")
            .field("nslots", &self.nslots)
            .field("live", &self.live)
            .finish()
    }
}

impl NsIndex {
    /// A new empty table with room for `nslots` (rounded to a power of two).
    pub fn new(nslots: usize) -> std::io::Result<Self> {
        let nslots = nslots.max(MIN_SLOTS).next_power_of_two();
        let memfd = File::from(memfd_create(c"maru-index", MFdFlags::MFD_CLOEXEC)?);
        memfd.set_len(table_bytes(nslots) as u64)?;
        // SAFETY: a private-to-us memfd; clients only get read-only descriptors and all access
        // goes through atomics (maru::index). Its pages are all made at once (a rebuild fills
        // the table at once; faulting them in one by one costs more than the inserts).
        let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&memfd)? };
        // SAFETY: freshly created zeroed memfd of table_bytes(nslots) bytes, written only here.
        unsafe { TableWriter::init(map.as_mut_ptr(), map.len(), nslots) };
        Ok(NsIndex {
            memfd,
            map,
            nslots,
            live: 0,
            tombstones: 0,
        })
    }

    fn writer(&self) -> TableWriter<'_> {
        // SAFETY: the mapping holds an initialized table (see new) and lives as long as self.
        let t = unsafe { Table::from_raw(self.map.as_ptr(), self.map.len()) }
            .expect("initialized table");
        TableWriter::from_table(t)
    }

    /// Slots.
    pub fn nslots(&self) -> usize {
        self.nslots
    }

    /// True when one more insert would pass the load limit (70%).
    pub fn needs_rebuild(&self) -> bool {
        (self.live + self.tombstones + 1) * 10 > self.nslots * 7
    }

    /// Inserts a key known to be absent. Returns its slot.
    pub fn insert(&mut self, key: &str, v: SlotView) -> Option<usize> {
        let s = self.writer().insert(key.as_bytes(), v)?;
        self.live += 1;
        Some(s)
    }

    /// Tombstones slot `i`.
    pub fn remove(&mut self, i: usize) {
        self.writer().remove(i);
        self.live -= 1;
        self.tombstones += 1;
    }

    /// Updates flags of slot `i`.
    pub fn set_flags(&mut self, i: usize, flags: u32) {
        self.writer().set_flags(i, flags);
    }

    /// Publishes the count of imminent publications in this namespace.
    pub fn set_pending(&self, n: u64) {
        self.writer().set_pending(n);
    }

    /// Marks this table as replaced.
    pub fn retire(&self) {
        self.writer().retire();
    }

    /// A read-only descriptor of the table for a client.
    pub fn ro_fd(&self) -> std::io::Result<File> {
        OpenOptions::new()
            .read(true)
            .open(format!("/proc/self/fd/{}", self.memfd.as_raw_fd()))
    }

    /// Looks a key up (as a client would).
    pub fn lookup(&self, key: &str) -> Option<SlotView> {
        self.writer().table().lookup(key.as_bytes())
    }
}
