//! The shared namespace index: a hash table the daemon publishes in a memfd
//! and clients map read-only, so `exists` and repeated `retrieve` of a sealed
//! key take no round trip to the daemon.
//!
//! One table per namespace. The daemon is the only writer (under its store
//! lock); readers are lock-free and use a per-slot sequence lock. Every word is
//! accessed as an `AtomicU64`, so concurrent reads of memory another process
//! writes are well defined. Layout (all little-endian `u64` words, see
//! `doc/POOL-FORMAT.md`):
//!
//! ```text
//! header (8 words): magic, nslots, flags (bit 0 = retired), epoch, live, removals,
//!                   pending publications, fence
//! slot (40 words):  seq, generation, hash, size, pool|flags<<32, offset, key_len, reserved,
//!                   key bytes (32 words = 256 bytes, zero padded)
//! ```
//!
//! `generation == 0` marks a never-used slot (ends a probe), `generation == TOMBSTONE` a
//! deleted one. Linear probing; a key never moves while it lives, so a reader
//! that finds it is linearizable per slot. When the table fills up the daemon
//! builds a larger one and sets the retired flag on the old one; readers then
//! fetch the new table.
//!
//! The fence (cluster mode, 0 otherwise) is the instant, in [`boottime_ns`], until which the
//! table may be trusted: past it, this host may have been cut off from the cluster long
//! enough for another host to carve again what its entries occupy, so a reader asks the
//! daemon instead (which answers as it is then).

use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::name::MAX_NAME_LEN;

/// Nanoseconds of CLOCK_BOOTTIME, the clock of a table's fence (and of a grant's `until`):
/// every process of a host shares it, and setting the time of day does not move it.
pub fn boottime_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// Magic of an index table (`MARUIDX1`).
pub const INDEX_MAGIC: u64 = u64::from_le_bytes(*b"MARUIDX1");
/// Words in the header.
pub const HEADER_WORDS: usize = 8;
/// Words per slot.
pub const SLOT_WORDS: usize = 40;
/// Key words per slot.
const KEY_WORDS: usize = 32;
/// Generation value of a deleted slot.
pub const TOMBSTONE: u64 = u64::MAX;
/// Flag bit: entry is pinned (the operator's persistent pin).
pub const FLAG_PINNED: u32 = 1;
/// Flag bit: some client connection holds the entry (`Op::Hold`; not persistent).
pub const FLAG_HELD: u32 = 2;

/// Bytes needed for a table of `nslots` slots.
pub fn table_bytes(nslots: usize) -> usize {
    (HEADER_WORDS + nslots * SLOT_WORDS) * 8
}

/// FNV-1a, 64 bit: stable across builds and processes.
pub fn hash_key(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Never 0, so an empty slot is recognisable by generation alone.
    h | 1
}

/// What a slot says about a sealed entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotView {
    /// Entry generation.
    pub generation: u64,
    /// Size in bytes.
    pub size: u64,
    /// Pool id.
    pub pool: u32,
    /// Flags (`FLAG_PINNED`, `FLAG_HELD`).
    pub flags: u32,
    /// Where the entry is: its offset in a raw pool; in a memfs pool its file's inode number,
    /// or, for a small entry packed with others, [`pack_location`]'s code.
    pub offset: u64,
}

/// Bytes of one pack of a memfs pool (the file its small entries share).
pub const PACK_BYTES: u64 = 2 << 20;

/// Bit 63 of a memfs entry's location: the entry is packed with other small entries of its
/// namespace in one file of the pool (inode numbers and raw offsets never reach it).
pub const PACKED: u64 = 1 << 63;

/// The location of a packed memfs entry: pack file `pack`, `offset` bytes in.
pub fn pack_location(pack: u32, offset: u64) -> u64 {
    debug_assert!(offset < 1 << 32 && pack < 1 << 31);
    PACKED | u64::from(pack) << 32 | offset
}

/// The pack file and the offset in it of a packed entry's location; `None` for any other.
pub fn packed(location: u64) -> Option<(u32, u64)> {
    (location & PACKED != 0)
        .then_some((((location & !PACKED) >> 32) as u32, location & 0xffff_ffff))
}

/// A view of a table in memory (either side).
pub struct Table<'a> {
    words: &'a [AtomicU64],
}

impl<'a> Table<'a> {
    /// Wraps table memory.
    ///
    /// # Safety
    /// `ptr` must be 8-byte aligned and valid for reads of `len` bytes for `'a`,
    /// and every access to that memory by anyone must be through atomics.
    pub unsafe fn from_raw(ptr: *const u8, len: usize) -> Option<Self> {
        if len < HEADER_WORDS * 8 || !(ptr as usize).is_multiple_of(8) {
            return None;
        }
        // SAFETY: caller guarantees validity and alignment; AtomicU64 has the layout of u64.
        let words = unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU64>(), len / 8) };
        let t = Table { words };
        if t.words[0].load(Ordering::Relaxed) != INDEX_MAGIC {
            return None;
        }
        let n = t.nslots();
        if n == 0 || !n.is_power_of_two() || table_bytes(n) > len {
            return None;
        }
        Some(t)
    }

    /// Slots in the table (a power of two).
    pub fn nslots(&self) -> usize {
        self.words[1].load(Ordering::Relaxed) as usize
    }

    /// True once the daemon replaced this table with another.
    pub fn retired(&self) -> bool {
        self.words[2].load(Ordering::Acquire) & 1 != 0
    }

    /// Changes with every update of any slot.
    pub fn epoch(&self) -> u64 {
        self.words[3].load(Ordering::Acquire)
    }

    /// Changes with every removal (delete, eviction).
    pub fn removals(&self) -> u64 {
        self.words[5].load(Ordering::Acquire)
    }

    /// Entries of this namespace whose writer has closed them and whose publication is
    /// imminent (written through the mount). A miss while this is non-zero must ask the daemon.
    pub fn pending(&self) -> u64 {
        self.words[6].load(Ordering::Acquire)
    }

    /// The fence: until when the table may be trusted ([`boottime_ns`]; 0: always).
    pub fn fence(&self) -> u64 {
        self.words[7].load(Ordering::Acquire)
    }

    /// True once the fence has passed: what the table says must be asked of the daemon.
    pub fn fenced(&self) -> bool {
        let until = self.fence();
        until != 0 && boottime_ns() >= until
    }

    /// Live entries.
    pub fn live(&self) -> u64 {
        self.words[4].load(Ordering::Relaxed)
    }

    fn slot(&self, i: usize) -> &[AtomicU64] {
        let s = HEADER_WORDS + i * SLOT_WORDS;
        &self.words[s..s + SLOT_WORDS]
    }

    /// Asks the CPU to bring the slot where a lookup of the key hashed `h` starts into its
    /// cache, so that the cache misses of a batch's lookups overlap instead of adding up.
    pub fn prefetch(&self, h: u64) {
        let i = (h as usize) & (self.nslots() - 1);
        let s = self.slot(i);
        // The slot's first line (generation, hash, size...) and the one its key starts in.
        prefetch_line(s[0].as_ptr());
        prefetch_line(s[8].as_ptr());
    }

    /// The slots a key hashed `h` may be in, in probing order (linear, from `h & (slots − 1)`,
    /// each slot once).
    fn probe(&self, h: u64) -> impl Iterator<Item = usize> {
        let mask = self.nslots() - 1;
        (0..=mask).map(move |k| (h as usize).wrapping_add(k) & mask)
    }

    /// Looks a key up. Lock-free; retries a slot while its writer is mid-update, up to
    /// [`MAX_SPINS`] times: [`Stuck`] then (the writer stopped or died in the middle, and
    /// marud, whose answer waits for the update, is to be asked).
    pub fn lookup(&self, key: &[u8]) -> Result<Option<SlotView>, Stuck> {
        self.lookup_hashed(key, hash_key(key))
    }

    /// [`lookup`](Self::lookup) of a key whose [`hash_key`] the caller has computed already.
    pub fn lookup_hashed(&self, key: &[u8], h: u64) -> Result<Option<SlotView>, Stuck> {
        if key.len() > MAX_NAME_LEN {
            return Ok(None);
        }
        let mut spins = 0u32;
        let mut retry = || {
            spins += 1;
            std::hint::spin_loop();
            if spins < MAX_SPINS {
                Ok(())
            } else {
                Err(Stuck)
            }
        };
        for i in self.probe(h) {
            let s = self.slot(i);
            loop {
                let seq1 = s[0].load(Ordering::Acquire);
                if seq1 & 1 == 1 {
                    retry()?;
                    continue;
                }
                let generation = s[1].load(Ordering::Relaxed);
                if generation == 0 {
                    fence(Ordering::Acquire);
                    if s[0].load(Ordering::Relaxed) != seq1 {
                        retry()?;
                        continue;
                    }
                    return Ok(None);
                }
                let mut hit = None;
                if generation != TOMBSTONE
                    && s[2].load(Ordering::Relaxed) == h
                    && s[6].load(Ordering::Relaxed) as usize == key.len()
                    && key_matches(&s[8..8 + KEY_WORDS], key)
                {
                    let pf = s[4].load(Ordering::Relaxed);
                    hit = Some(SlotView {
                        generation,
                        size: s[3].load(Ordering::Relaxed),
                        pool: pf as u32,
                        flags: (pf >> 32) as u32,
                        offset: s[5].load(Ordering::Relaxed),
                    });
                }
                fence(Ordering::Acquire);
                if s[0].load(Ordering::Relaxed) != seq1 {
                    retry()?;
                    continue;
                }
                if hit.is_some() {
                    return Ok(hit);
                }
                break;
            }
        }
        Ok(None)
    }
}

/// How many times one lookup retries slots its writer is updating before it gives up: far
/// more than an update takes (a few stores), so only a writer stopped in the middle (by the
/// scheduler, for long, or dead) makes a reader ask marud instead.
pub const MAX_SPINS: u32 = 1 << 16;

/// A lookup found a slot mid-update for longer than [`MAX_SPINS`] retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stuck;

/// A hint to the CPU to load the cache line at `p` (no effect where there is no such hint).
#[inline]
fn prefetch_line(p: *const u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it reads nothing visible and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn key_matches(words: &[AtomicU64], key: &[u8]) -> bool {
    for (wi, chunk) in key.chunks(8).enumerate() {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        if words[wi].load(Ordering::Relaxed) != u64::from_le_bytes(b) {
            return false;
        }
    }
    true
}

/// The daemon's side of a table: it alone writes.
pub struct TableWriter<'a> {
    t: Table<'a>,
}

impl<'a> TableWriter<'a> {
    /// Initializes zeroed memory as an empty table of `nslots` slots.
    ///
    /// # Safety
    /// As [`Table::from_raw`], the memory must be zeroed, writable, at least
    /// `table_bytes(nslots)` long, and written by no one else.
    pub unsafe fn init(ptr: *mut u8, len: usize, nslots: usize) -> Self {
        assert!(nslots.is_power_of_two() && table_bytes(nslots) <= len);
        // SAFETY: caller guarantees validity; AtomicU64 has the layout of u64.
        let words = unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU64>(), len / 8) };
        words[1].store(nslots as u64, Ordering::Relaxed);
        words[0].store(INDEX_MAGIC, Ordering::Release);
        TableWriter { t: Table { words } }
    }

    /// Wraps an existing table for writing.
    ///
    /// The caller must be the table's only writer (the daemon holds its store lock).
    pub fn from_table(t: Table<'a>) -> Self {
        TableWriter { t }
    }

    /// The read view.
    pub fn table(&self) -> &Table<'a> {
        &self.t
    }

    fn bump_epoch(&self) {
        self.t.words[3].fetch_add(1, Ordering::Release);
    }

    /// Inserts a key the caller knows is absent. Returns its slot, or `None` when full.
    pub fn insert(&self, key: &[u8], v: SlotView) -> Option<usize> {
        assert!(key.len() <= MAX_NAME_LEN && v.generation != 0 && v.generation != TOMBSTONE);
        let h = hash_key(key);
        for i in self.t.probe(h) {
            let s = self.t.slot(i);
            let generation = s[1].load(Ordering::Relaxed);
            if generation == 0 || generation == TOMBSTONE {
                self.write_slot(s, |s| {
                    s[1].store(v.generation, Ordering::Relaxed);
                    s[2].store(h, Ordering::Relaxed);
                    s[3].store(v.size, Ordering::Relaxed);
                    s[4].store(
                        u64::from(v.pool) | (u64::from(v.flags) << 32),
                        Ordering::Relaxed,
                    );
                    s[5].store(v.offset, Ordering::Relaxed);
                    s[6].store(key.len() as u64, Ordering::Relaxed);
                    for (wi, w) in s[8..8 + KEY_WORDS].iter().enumerate() {
                        let mut b = [0u8; 8];
                        let lo = (wi * 8).min(key.len());
                        let hi = (wi * 8 + 8).min(key.len());
                        b[..hi - lo].copy_from_slice(&key[lo..hi]);
                        w.store(u64::from_le_bytes(b), Ordering::Relaxed);
                    }
                });
                self.t.words[4].fetch_add(1, Ordering::Relaxed);
                self.bump_epoch();
                return Some(i);
            }
        }
        None
    }

    /// The slot holding live key `key`, if any (the writer's own probe: no sequence lock).
    pub fn find(&self, key: &[u8]) -> Option<usize> {
        let h = hash_key(key);
        for i in self.t.probe(h) {
            let s = self.t.slot(i);
            let generation = s[1].load(Ordering::Relaxed);
            if generation == 0 {
                return None;
            }
            if generation != TOMBSTONE
                && s[2].load(Ordering::Relaxed) == h
                && s[6].load(Ordering::Relaxed) == key.len() as u64
                && key_matches(&s[8..8 + KEY_WORDS], key)
            {
                return Some(i);
            }
        }
        None
    }

    /// Copies every live slot of `old` (a table this writer also writes, or one nobody
    /// writes any more) into this one, which must be empty and have room: slot by slot in
    /// `old`'s order, placed by the hash the slot holds, so a growth reads the old table
    /// once, in order, and hashes no key again.
    pub fn copy_live_from(&self, old: &Table<'_>) -> usize {
        let mut live = 0;
        for j in 0..old.nslots() {
            let from = old.slot(j);
            let generation = from[1].load(Ordering::Relaxed);
            if generation == 0 || generation == TOMBSTONE {
                continue;
            }
            let Some(i) = self
                .t
                .probe(from[2].load(Ordering::Relaxed))
                .find(|&i| self.t.slot(i)[1].load(Ordering::Relaxed) == 0)
            else {
                panic!("a table copied into has room for every live key");
            };
            self.write_slot(self.t.slot(i), |s| {
                for (w, f) in s[1..].iter().zip(&from[1..]) {
                    w.store(f.load(Ordering::Relaxed), Ordering::Relaxed);
                }
            });
            live += 1;
        }
        self.t.words[4].fetch_add(live as u64, Ordering::Relaxed);
        self.bump_epoch();
        live
    }

    /// Marks slot `i` deleted.
    pub fn remove(&self, i: usize) {
        let s = self.t.slot(i);
        self.write_slot(s, |s| s[1].store(TOMBSTONE, Ordering::Relaxed));
        self.t.words[4].fetch_sub(1, Ordering::Relaxed);
        self.t.words[5].fetch_add(1, Ordering::Release);
        self.bump_epoch();
    }

    /// Updates the flags of slot `i`.
    pub fn set_flags(&self, i: usize, flags: u32) {
        let s = self.t.slot(i);
        self.write_slot(s, |s| {
            let pf = s[4].load(Ordering::Relaxed);
            s[4].store(
                (pf & 0xffff_ffff) | (u64::from(flags) << 32),
                Ordering::Relaxed,
            );
        });
        self.bump_epoch();
    }

    /// Sets the pending-publication count.
    pub fn set_pending(&self, n: u64) {
        self.t.words[6].store(n, Ordering::Release);
    }

    /// Sets the fence ([`Table::fence`]).
    pub fn set_fence(&self, until: u64) {
        self.t.words[7].store(until, Ordering::Release);
    }

    /// Marks this table replaced.
    pub fn retire(&self) {
        self.t.words[2].fetch_or(1, Ordering::Release);
        self.bump_epoch();
    }

    fn write_slot(&self, s: &[AtomicU64], f: impl FnOnce(&[AtomicU64])) {
        let seq = s[0].load(Ordering::Relaxed);
        s[0].store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        f(s);
        s[0].store(seq + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_location_names_its_pack_and_offset() {
        let at = pack_location(7, 3 * 4096);
        assert_eq!(packed(at), Some((7, 3 * 4096)));
        assert_eq!(
            packed(pack_location((1 << 31) - 1, (1 << 32) - 4096)),
            Some(((1 << 31) - 1, (1 << 32) - 4096))
        );
        // Inode numbers and raw offsets are never packed locations.
        assert_eq!(packed(123_456), None);
        assert_eq!(packed(1 << 40), None);
    }

    fn view(generation: u64) -> SlotView {
        SlotView {
            generation,
            size: generation * 10,
            pool: 1,
            flags: 0,
            offset: generation * 4096,
        }
    }

    #[test]
    fn insert_lookup_remove() {
        let n = 64;
        let mut mem = vec![0u64; table_bytes(n) / 8];
        // SAFETY: the vector is zeroed, aligned and outlives the writer.
        let w = unsafe { TableWriter::init(mem.as_mut_ptr().cast(), mem.len() * 8, n) };
        let mut slots = Vec::new();
        for g in 1..=40u64 {
            slots.push(w.insert(format!("key-{g}").as_bytes(), view(g)).unwrap());
        }
        for g in 1..=40u64 {
            assert_eq!(
                w.table().lookup(format!("key-{g}").as_bytes()),
                Ok(Some(view(g)))
            );
        }
        assert_eq!(w.table().lookup(b"nope"), Ok(None));
        w.remove(slots[4]);
        assert_eq!(w.table().lookup(b"key-5"), Ok(None));
        assert_eq!(w.table().lookup(b"key-6"), Ok(Some(view(6))));
        w.set_flags(slots[5], FLAG_PINNED);
        assert_eq!(
            w.table().lookup(b"key-6").unwrap().unwrap().flags,
            FLAG_PINNED
        );
        assert_eq!(w.table().live(), 39);
        let long = [b'x'; 255];
        w.insert(&long, view(99)).unwrap();
        assert_eq!(w.table().lookup(&long), Ok(Some(view(99))));
    }

    #[test]
    fn the_writer_finds_keys_and_a_copy_keeps_only_live_ones() {
        let n = 64;
        let mut mem = vec![0u64; table_bytes(n) / 8];
        // SAFETY: the vector is zeroed, aligned and outlives the writer.
        let w = unsafe { TableWriter::init(mem.as_mut_ptr().cast(), mem.len() * 8, n) };
        for g in 1..=40u64 {
            let key = format!("key-{g}");
            let at = w.insert(key.as_bytes(), view(g)).unwrap();
            assert_eq!(w.find(key.as_bytes()), Some(at));
        }
        // Same length and hash bucket region, other bytes: not found.
        assert_eq!(w.find(b"key-99"), None);
        w.remove(w.find(b"key-7").unwrap());
        assert_eq!(w.find(b"key-7"), None, "a tombstone is no key");
        w.set_flags(w.find(b"key-8").unwrap(), FLAG_HELD);
        let big = 256;
        let mut mem2 = vec![0u64; table_bytes(big) / 8];
        // SAFETY: as above.
        let w2 = unsafe { TableWriter::init(mem2.as_mut_ptr().cast(), mem2.len() * 8, big) };
        assert_eq!(w2.copy_live_from(w.table()), 39);
        assert_eq!(w2.table().live(), 39);
        for g in (1..=40u64).filter(|g| *g != 7) {
            let mut v = view(g);
            if g == 8 {
                v.flags = FLAG_HELD;
            }
            assert_eq!(
                w2.table().lookup(format!("key-{g}").as_bytes()),
                Ok(Some(v))
            );
            assert!(w2.find(format!("key-{g}").as_bytes()).is_some());
        }
        assert_eq!(w2.table().lookup(b"key-7"), Ok(None));
        assert_ne!(w2.table().epoch(), 0, "readers see the copy as a change");
    }

    #[test]
    fn a_table_is_trusted_until_its_fence() {
        let mut buf = vec![0u64; table_bytes(16) / 8];
        // SAFETY: a zeroed, aligned buffer of the table's size.
        let w = unsafe { TableWriter::init(buf.as_mut_ptr().cast(), buf.len() * 8, 16) };
        assert!(!w.table().fenced(), "no fence (a single host)");
        w.set_fence(boottime_ns() + 10_000_000_000);
        assert!(!w.table().fenced(), "before the fence");
        w.set_fence(boottime_ns());
        assert!(w.table().fenced(), "past the fence");
        w.set_fence(1);
        assert!(w.table().fenced(), "fenced off now");
    }

    #[test]
    fn full_table_refuses() {
        let n = 4;
        let mut mem = vec![0u64; table_bytes(n) / 8];
        // SAFETY: as above.
        let w = unsafe { TableWriter::init(mem.as_mut_ptr().cast(), mem.len() * 8, n) };
        for g in 1..=4 {
            assert!(w.insert(format!("{g}").as_bytes(), view(g)).is_some());
        }
        assert!(w.insert(b"5", view(5)).is_none());
        // Lookup of a missing key in a full table terminates.
        assert_eq!(w.table().lookup(b"6"), Ok(None));
    }

    #[test]
    fn a_slot_left_mid_update_stops_a_lookup_that_reaches_it() {
        let n = 16;
        let mut mem = vec![0u64; table_bytes(n) / 8];
        // SAFETY: as above.
        let w = unsafe { TableWriter::init(mem.as_mut_ptr().cast(), mem.len() * 8, n) };
        let at = w.insert(b"k", view(1)).unwrap();
        // Its writer gone between the sequence's two stores (a marud killed mid-update).
        let seq = &w.t.slot(at)[0];
        seq.store(seq.load(Ordering::Relaxed) + 1, Ordering::Release);
        assert_eq!(w.table().lookup(b"k"), Err(Stuck));
        // A key whose probe ends before that slot is still answered.
        let other = (0u32..)
            .map(|i| format!("o{i}"))
            .find(|k| {
                let h = hash_key(k.as_bytes()) as usize & (n - 1);
                h != at && w.t.slot(h)[1].load(Ordering::Relaxed) == 0
            })
            .unwrap();
        assert_eq!(w.table().lookup(other.as_bytes()), Ok(None));
    }
}
