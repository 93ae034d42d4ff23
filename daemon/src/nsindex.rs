//! The daemon's side of the shared namespace index (see `maru::index`): a memfd
//! per namespace, mapped read-write here and handed to clients read-only.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

use nix::sys::memfd::{MFdFlags, memfd_create};

use maru::index::{SlotView, Table, TableWriter, table_bytes};

/// Smallest table.
pub const MIN_SLOTS: usize = 1024;

/// Tables of at least this many slots (5 MiB) have their successor made ahead of need.
const AHEAD_MIN_SLOTS: usize = 16 * 1024;

/// A table being made on a thread of its own, ahead of need.
type Ahead = std::thread::JoinHandle<std::io::Result<NsIndex>>;

/// One namespace's index table.
pub struct NsIndex {
    memfd: File,
    map: memmap2::MmapMut,
    nslots: usize,
    /// Slots holding a live key.
    pub live: usize,
    /// Slots holding a tombstone.
    pub tombstones: usize,
    /// The table twice as large, made on another thread once this one is 55% full (its
    /// memory is most of a growth's cost: 2.4 ms per MiB on the VMs measured), so that the
    /// growth under the store's lock only fills it.
    ahead: Option<Ahead>,
}

impl std::fmt::Debug for NsIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NsIndex")
            .field("nslots", &self.nslots)
            .field("live", &self.live)
            .finish()
    }
}

/// Seals a table's memfd once marud maps it for writing: its size for ever, and writing
/// to everyone else. A client's read-only descriptor can be opened again read-write through
/// `/proc/self/fd` (the memfd's mode is 0777), and its writes or a truncation (a fault in
/// marud's accesses) would stall or mislead every other client; sealed, it can write nothing,
/// map nothing writable, and change no size. marud's own mapping, made before, stays writable.
fn seal(memfd: &File) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    fcntl(
        memfd,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_FUTURE_WRITE
                | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    Ok(())
}

impl NsIndex {
    /// A new empty table with room for `nslots` (rounded to a power of two).
    pub fn new(nslots: usize) -> std::io::Result<Self> {
        let nslots = nslots.max(MIN_SLOTS).next_power_of_two();
        let memfd = File::from(memfd_create(
            c"maru-index",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )?);
        memfd.set_len(table_bytes(nslots) as u64)?;
        // SAFETY: a private-to-us memfd; clients only get read-only descriptors and all access
        // goes through atomics (maru::index). Its pages are all made at once (a rebuild fills
        // the table at once; faulting them in one by one costs more than the inserts).
        let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&memfd)? };
        seal(&memfd)?;
        // SAFETY: freshly created zeroed memfd of table_bytes(nslots) bytes, written only here.
        unsafe { TableWriter::init(map.as_mut_ptr(), map.len(), nslots) };
        Ok(NsIndex {
            memfd,
            map,
            nslots,
            live: 0,
            tombstones: 0,
            ahead: None,
        })
    }

    /// An empty table with room for `nslots` (rounded as [`NsIndex::new`] does) to replace
    /// this one: the one made ahead when it has that size, a new one otherwise.
    fn successor(&mut self, nslots: usize) -> std::io::Result<NsIndex> {
        let want = nslots.max(MIN_SLOTS).next_power_of_two();
        if let Some(h) = self.ahead.take_if(|h| h.is_finished())
            && let Ok(Ok(ix)) = h.join()
            && ix.nslots == want
        {
            return Ok(ix);
        }
        // One still being made is left to finish on its own, and dropped.
        NsIndex::new(want)
    }

    /// Starts making the next table once this one is 55% full.
    fn make_ahead(&mut self) {
        if self.ahead.is_none()
            && self.nslots >= AHEAD_MIN_SLOTS
            && (self.live + self.tombstones) * 20 > self.nslots * 11
        {
            let n = self.nslots * 2;
            self.ahead = std::thread::Builder::new()
                .name("maru-index".into())
                .spawn(move || NsIndex::new(n))
                .ok();
        }
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

    /// Inserts a key known to be absent; false when the table is full.
    pub fn insert(&mut self, key: &str, v: SlotView) -> bool {
        if self.writer().insert(key.as_bytes(), v).is_none() {
            return false;
        }
        self.live += 1;
        self.make_ahead();
        true
    }

    /// Tombstones `key`'s slot.
    pub fn remove(&mut self, key: &str) {
        let w = self.writer();
        if let Some(i) = w.find(key.as_bytes()) {
            w.remove(i);
            self.live -= 1;
            self.tombstones += 1;
        }
    }

    /// Updates the flags of `key`'s slot.
    pub fn set_flags(&mut self, key: &str, flags: u32) {
        let w = self.writer();
        if let Some(i) = w.find(key.as_bytes()) {
            w.set_flags(i, flags);
        }
    }

    /// A fresh table of twice the slots the live keys need (a full one doubles: 35% loaded,
    /// grown again at 70%) holding this one's live keys, which is marked retired. Its memory
    /// is the one made ahead when it has that size.
    pub fn grown(&mut self) -> std::io::Result<NsIndex> {
        let mut ix = self.successor((self.live + 1) * 2)?;
        ix.live = ix.writer().copy_live_from(self.writer().table());
        ix.set_fence(self.writer().table().fence());
        self.retire();
        Ok(ix)
    }

    /// Publishes the count of imminent publications in this namespace.
    pub fn set_pending(&self, n: u64) {
        self.writer().set_pending(n);
    }

    /// Publishes until when clients may trust the table (`maru::index::Table::fence`).
    pub fn set_fence(&self, until: u64) {
        self.writer().set_fence(until);
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

    /// Looks a key up (as a client would), as its only writer: no slot is mid-update.
    pub fn lookup(&self, key: &str) -> Option<SlotView> {
        self.writer()
            .table()
            .lookup(key.as_bytes())
            .expect("the writer leaves no slot mid-update")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(generation: u64) -> SlotView {
        SlotView {
            generation,
            size: 1,
            pool: 0,
            flags: 0,
            offset: generation,
        }
    }

    #[test]
    fn a_grown_table_holds_the_live_keys_in_the_table_made_ahead() {
        let mut ix = NsIndex::new(AHEAD_MIN_SLOTS).unwrap();
        let n = AHEAD_MIN_SLOTS * 7 / 10;
        for g in 1..=n as u64 {
            assert!(ix.insert(&format!("k{g}"), view(g)));
        }
        assert!(ix.needs_rebuild());
        ix.remove("k1");
        ix.set_flags("k2", maru::index::FLAG_PINNED);
        // Made at 55%, on its own thread: wait for it, as a store going on would have.
        while !ix.ahead.as_ref().unwrap().is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let grown = ix.grown().unwrap();
        assert!(ix.ahead.is_none(), "the table made ahead was taken");
        assert_eq!(grown.nslots(), AHEAD_MIN_SLOTS * 2);
        assert_eq!(grown.live, n - 1);
        assert!(ix.writer().table().retired());
        assert_eq!(grown.lookup("k1"), None);
        assert_eq!(grown.lookup("k2").unwrap().flags, maru::index::FLAG_PINNED);
        assert_eq!(grown.lookup(&format!("k{n}")), Some(view(n as u64)));
    }

    #[test]
    fn a_client_can_change_nothing_of_a_table() {
        use std::os::unix::fs::FileExt;
        let mut ix = NsIndex::new(MIN_SLOTS).unwrap();
        let ro = ix.ro_fd().unwrap();
        // What a client may do with its descriptor: open it again for writing (even root).
        let rw = OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", ro.as_raw_fd()));
        if let Ok(rw) = rw {
            assert!(rw.write_all_at(&[0xff; 8], 0).is_err(), "a write");
            assert!(rw.set_len(0).is_err(), "a truncation");
            assert!(rw.set_len(1 << 30).is_err(), "a growth");
            // SAFETY: a mapping attempt on a file of ours, dropped at once if made.
            let map = unsafe { memmap2::MmapOptions::new().map_mut(&rw) };
            assert!(map.is_err(), "a writable mapping");
        }
        // SAFETY: as above.
        let map = unsafe { memmap2::MmapOptions::new().map_mut(&ro) };
        assert!(map.is_err());
        // SAFETY: a read-only mapping of the table, read through atomics.
        let map = unsafe { memmap2::Mmap::map(&ro) }.unwrap();
        // marud's own mapping still writes.
        assert!(ix.insert("k", view(7)));
        // SAFETY: the mapping is page aligned and lives while the table is read.
        let t = unsafe { Table::from_raw(map.as_ptr(), map.len()) }.unwrap();
        assert_eq!(t.lookup(b"k"), Ok(Some(view(7))));
    }
}
