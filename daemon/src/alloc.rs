//! First-fit extent allocator with splitting and coalescing, used to carve raw
//! pools (devdax, file) into regions.

use std::collections::BTreeMap;

/// Free extents of an address range.
#[derive(Debug, Clone)]
pub struct ExtentAlloc {
    /// offset -> length of each free extent; never adjacent (always coalesced).
    free: BTreeMap<u64, u64>,
    start: u64,
    end: u64,
}

/// Rounds `v` up to a multiple of `align` (a power of two).
pub fn align_up(v: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (v + align - 1) & !(align - 1)
}

impl ExtentAlloc {
    /// Everything in `[start, end)` free.
    pub fn new(start: u64, end: u64) -> Self {
        let mut free = BTreeMap::new();
        if end > start {
            free.insert(start, end - start);
        }
        ExtentAlloc { free, start, end }
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// Number of free extents (1 when fully coalesced and empty).
    #[cfg(test)]
    pub fn fragments(&self) -> usize {
        self.free.len()
    }

    /// Allocates `len` bytes at an `align`-aligned offset, first fit.
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let mut found = None;
        for (&off, &flen) in &self.free {
            let a = align_up(off, align);
            if a.checked_add(len)? <= off + flen {
                found = Some((off, flen, a));
                break;
            }
        }
        let (off, flen, a) = found?;
        self.free.remove(&off);
        if a > off {
            self.free.insert(off, a - off);
        }
        let tail = off + flen - (a + len);
        if tail > 0 {
            self.free.insert(a + len, tail);
        }
        Some(a)
    }

    /// Marks `[off, off+len)` used; it must be entirely free. Used by recovery.
    pub fn reserve(&mut self, off: u64, len: u64) -> bool {
        let Some((&foff, &flen)) = self.free.range(..=off).next_back() else {
            return false;
        };
        if off + len > foff + flen {
            return false;
        }
        self.free.remove(&foff);
        if off > foff {
            self.free.insert(foff, off - foff);
        }
        if foff + flen > off + len {
            self.free.insert(off + len, foff + flen - (off + len));
        }
        true
    }

    /// Frees `[off, off+len)`, coalescing with neighbours.
    ///
    /// # Panics
    /// If the extent overlaps free space or leaves the managed range (a double free).
    pub fn free(&mut self, off: u64, len: u64) {
        assert!(
            len > 0 && off >= self.start && off + len <= self.end,
            "free out of range"
        );
        let mut start = off;
        let mut size = len;
        if let Some((&poff, &plen)) = self.free.range(..off).next_back() {
            assert!(poff + plen <= off, "double free at {off:#x}");
            if poff + plen == off {
                self.free.remove(&poff);
                start = poff;
                size += plen;
            }
        }
        if let Some((&noff, &nlen)) = self.free.range(off..).next() {
            assert!(off + len <= noff, "double free at {off:#x}");
            if off + len == noff {
                self.free.remove(&noff);
                size += nlen;
            }
        }
        self.free.insert(start, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MB2: u64 = 2 << 20;

    #[test]
    fn split_and_coalesce() {
        let mut a = ExtentAlloc::new(MB2, 10 * MB2);
        let x = a.alloc(MB2, MB2).unwrap();
        let y = a.alloc(3 * MB2, MB2).unwrap();
        let z = a.alloc(MB2, MB2).unwrap();
        assert_eq!((x, y, z), (MB2, 2 * MB2, 5 * MB2));
        a.free(y, 3 * MB2);
        assert_eq!(a.alloc(2 * MB2, MB2), Some(2 * MB2));
        a.free(2 * MB2, 2 * MB2);
        a.free(x, MB2);
        a.free(z, MB2);
        assert_eq!(a.fragments(), 1);
        assert_eq!(a.free_bytes(), 9 * MB2);
        assert!(a.alloc(10 * MB2, MB2).is_none());
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = ExtentAlloc::new(0, 8 * MB2);
        let x = a.alloc(MB2, MB2).unwrap();
        a.free(x, MB2);
        a.free(x, MB2);
    }

    #[test]
    fn reserve_for_recovery() {
        let mut a = ExtentAlloc::new(MB2, 8 * MB2);
        assert!(a.reserve(3 * MB2, MB2));
        assert!(!a.reserve(3 * MB2, MB2));
        assert_eq!(a.alloc(2 * MB2, MB2), Some(MB2));
        assert_eq!(a.alloc(2 * MB2, MB2), Some(4 * MB2));
        assert_eq!(a.free_bytes(), 2 * MB2);
    }

    proptest! {
        /// Random alloc/free sequences: no overlap, alignment held, accounting exact,
        /// and everything coalesces back into one extent once all is freed.
        #[test]
        fn no_overlap_alignment_coalescing(ops in proptest::collection::vec((1u64..=8, any::<bool>(), any::<prop::sample::Index>()), 1..200)) {
            let cap = 64 * MB2;
            let mut a = ExtentAlloc::new(MB2, MB2 + cap);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (units, is_alloc, pick) in ops {
                if is_alloc || live.is_empty() {
                    let len = units * MB2 / 2 + 4096 * units;
                    let len = align_up(len, MB2);
                    if let Some(off) = a.alloc(len, MB2) {
                        prop_assert_eq!(off % MB2, 0);
                        prop_assert!(off >= MB2 && off + len <= MB2 + cap);
                        for &(o, l) in &live {
                            prop_assert!(off + len <= o || o + l <= off, "overlap");
                        }
                        live.push((off, len));
                    }
                } else {
                    let (o, l) = live.swap_remove(pick.index(live.len()));
                    a.free(o, l);
                }
                let used: u64 = live.iter().map(|x| x.1).sum();
                prop_assert_eq!(a.free_bytes() + used, cap);
            }
            for (o, l) in live.drain(..) {
                a.free(o, l);
            }
            prop_assert_eq!(a.fragments(), 1);
            prop_assert_eq!(a.free_bytes(), cap);
        }
    }
}
