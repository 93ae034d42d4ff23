//! The bytes of an entry written through the mount into a raw pool: held by the daemon while
//! the entry is written, copied into the extent reserved for it at its writer's close and
//! again at publication if they changed. They have a lock of their own, never taken for long
//! with the store's held: writes, reads and the copy into the pool (up to `max_copy_entry`,
//! 1 GiB by default) run without the store's lock. Reads share it, so that the store, which
//! only looks under its own lock (never waits), finds it readable while the entry is read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use maru::Result;
use parking_lot::RwLock;

use crate::store::authority::{Authority, fenced_error};

/// The bytes of one entry being written.
#[derive(Debug, Default)]
pub struct Buffered {
    data: Vec<u8>,
    /// Where the first bytes were copied whole, unchanged since: an offset in the pool and
    /// how many.
    copied: Option<(u64, u64)>,
}

/// A buffer shared by the store's bookkeeping and the threads that write, read or copy it.
pub type Shared = Arc<RwLock<Buffered>>;

impl Buffered {
    /// A new, empty buffer.
    pub fn shared() -> Shared {
        Arc::default()
    }

    /// Writes `bytes` at `offset`, growing the buffer as needed.
    pub fn write(&mut self, offset: usize, bytes: &[u8]) {
        let end = offset + bytes.len();
        if self.data.len() < end {
            self.data.resize(end, 0);
        }
        self.data[offset..end].copy_from_slice(bytes);
        self.copied = None;
    }

    /// Sets its length to `len` (cut, or grown with zeros).
    pub fn resize(&mut self, len: usize) {
        if self.data.len() != len {
            self.data.resize(len, 0);
            self.copied = None;
        }
    }

    /// Grows it with zeros to at least `len` bytes.
    pub fn grow(&mut self, len: usize) {
        if self.data.len() < len {
            self.resize(len);
        }
    }

    /// Up to `len` bytes from `offset` (fewer past its end).
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let s = offset.min(self.data.len());
        self.data[s..(s + len).min(self.data.len())].to_vec()
    }

    /// Whether its first `len` bytes are at `offset` of the pool as they are now.
    pub fn copied_to(&self, offset: u64, len: u64) -> bool {
        self.copied == Some((offset, len))
    }
}

/// The copy of a buffer's first bytes into the extent reserved for them ([`super::Pool::commit`]
/// of a raw pool), to be run without the store's lock. The extent stays the entry's meanwhile:
/// the store marks the writer as copying, and neither another copy of it nor its drop goes on
/// until this one is done.
pub struct CopyIn {
    buf: Shared,
    file: Arc<File>,
    offset: u64,
    len: u64,
    authority: Arc<dyn Authority>,
}

impl CopyIn {
    /// The copy of the first `len` bytes of `buf` to `offset` of the pool's `file`; refused once
    /// this host is fenced off the pool (`authority`).
    pub fn new(
        buf: Shared,
        file: Arc<File>,
        offset: u64,
        len: u64,
        authority: Arc<dyn Authority>,
    ) -> CopyIn {
        CopyIn {
            buf,
            file,
            offset,
            len,
            authority,
        }
    }

    /// Copies, holding the buffer's lock (a write to it waits); nothing when its bytes are
    /// there already. Bytes the buffer does not have (a size set past what was written) are
    /// zeros.
    pub fn run(self) -> Result<()> {
        let mut b = self.buf.write();
        if b.copied_to(self.offset, self.len) {
            return Ok(());
        }
        if self.authority.fenced() {
            return Err(fenced_error());
        }
        let n = (self.len as usize).min(b.data.len());
        self.file.write_all_at(&b.data[..n], self.offset)?;
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let mut at = n as u64;
        while at < self.len {
            let k = (self.len - at).min(ZEROS.len() as u64) as usize;
            self.file.write_all_at(&ZEROS[..k], self.offset + at)?;
            at += k as u64;
        }
        b.copied = Some((self.offset, self.len));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::authority::LocalAuthority;

    fn copy(buf: &Shared, file: &Arc<File>, offset: u64, len: u64) -> Result<()> {
        let auth: Arc<dyn Authority> = Arc::new(LocalAuthority::default());
        CopyIn::new(buf.clone(), file.clone(), offset, len, auth).run()
    }

    #[test]
    fn a_copy_takes_the_first_bytes_pads_with_zeros_and_is_made_again_after_a_change() {
        let file = Arc::new(tempfile::tempfile().unwrap());
        file.write_all_at(&[9; 64], 0).unwrap();
        let buf = Buffered::shared();
        buf.write().write(0, b"abcdef");
        copy(&buf, &file, 8, 4).unwrap();
        assert!(buf.read().copied_to(8, 4));
        let mut got = [0; 16];
        file.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(
            &got,
            b"\x09\x09\x09\x09\x09\x09\x09\x09abcd\x09\x09\x09\x09"
        );
        // Past what was written: zeros, not what the extent held before.
        copy(&buf, &file, 8, 8).unwrap();
        file.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got[8..], b"abcdef\0\0");
        // A write after the copy makes it due again.
        buf.write().write(1, b"X");
        assert!(!buf.read().copied_to(8, 8));
        copy(&buf, &file, 8, 8).unwrap();
        file.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got[8..], b"aXcdef\0\0");
        assert_eq!(buf.read().read(4, 10), b"ef");
    }
}
