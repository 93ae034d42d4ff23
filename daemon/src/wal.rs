//! Write-ahead log of a raw pool's metadata, kept in the state directory: the file and the
//! writer. The records and their framing are `maru::format`'s (doc/POOL-FORMAT.md).
//!
//! Reading stops at the first record that is short, fails its checksum or does not parse (a
//! torn tail after a crash) and truncates the log there. A checkpoint rewrites the log as one
//! `Seal` record per live entry (written to a temporary file, synced, renamed).
//!
//! Writes go through [`LogSink`] so tests can stop the log after the Nth write
//! and check recovery from every such point.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use maru::format;

/// Where log bytes go: the seam for crash injection.
pub trait LogSink: Send {
    /// Appends bytes.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Makes appended bytes durable.
    fn sync(&mut self) -> io::Result<()>;
    /// Atomically replaces the whole log with `bytes` (checkpoint).
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()>;
}

/// What a log's writes wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Every record is synced (`--wal-sync`).
    EachRecord,
    /// A checkpoint's rewrite is synced before it replaces the log: a raw pool's log, whose
    /// pool (a file, a device) may outlive the host's memory.
    Checkpoints,
    /// Nothing is synced: the log describes memory that does not outlive the host (a memfs
    /// pool's packs, on its tmpfs), so only a crash of marud must be survived, which the
    /// page cache does. A rewrite synced under the store's lock cost a store 100 ms and more
    /// once the log held 100,000 records.
    Process,
}

/// The log file in the state directory.
pub struct FileSink {
    path: PathBuf,
    file: File,
    durability: Durability,
}

impl FileSink {
    /// Opens (creating) the log at `path`.
    pub fn open(path: &Path, durability: Durability) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        Ok(FileSink {
            path: path.to_owned(),
            file,
            durability,
        })
    }
}

impl LogSink for FileSink {
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all(bytes)?;
        if self.durability == Durability::EachRecord {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        let tmp = self.path.with_extension("wal.tmp");
        let durable = self.durability != Durability::Process;
        {
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            if durable {
                f.sync_all()?;
            }
        }
        std::fs::rename(&tmp, &self.path)?;
        if durable && let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        self.file = OpenOptions::new()
            .append(true)
            .read(true)
            .open(&self.path)?;
        Ok(())
    }
}

/// Reads a log file, truncating a torn tail. A missing file is an empty log.
pub fn read_log(path: &Path) -> io::Result<Vec<format::Record>> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    }
    let (recs, valid) = format::decode_records(&bytes);
    if valid < bytes.len() {
        tracing::warn!(
            path = %path.display(),
            dropped = bytes.len() - valid,
            "truncating a torn tail of the pool log"
        );
        OpenOptions::new()
            .write(true)
            .open(path)?
            .set_len(valid as u64)?;
    }
    Ok(recs)
}

/// The pool's metadata log.
pub struct Wal {
    sink: Box<dyn LogSink>,
    /// Records appended since the last checkpoint.
    pub since_checkpoint: u64,
}

impl Wal {
    /// Wraps a sink.
    pub fn new(sink: Box<dyn LogSink>) -> Self {
        Wal {
            sink,
            since_checkpoint: 0,
        }
    }

    /// Appends one record.
    pub fn append(&mut self, r: &format::Record) -> io::Result<()> {
        self.sink.append(&format::encode_record(r))?;
        self.since_checkpoint += 1;
        Ok(())
    }

    /// Rewrites the log as `live`.
    pub fn checkpoint(&mut self, live: &[format::Record]) -> io::Result<()> {
        let mut bytes = Vec::new();
        for r in live {
            bytes.extend_from_slice(&format::encode_record(r));
        }
        self.sink.replace(&bytes)?;
        self.since_checkpoint = 0;
        Ok(())
    }

    /// Syncs the log.
    pub fn sync(&mut self) -> io::Result<()> {
        self.sink.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::format::Record;

    #[test]
    fn a_torn_tail_is_cut_off_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.wal");
        assert!(
            read_log(&path).unwrap().is_empty(),
            "a missing log is empty"
        );
        let mut w = Wal::new(Box::new(
            FileSink::open(&path, Durability::Checkpoints).unwrap(),
        ));
        let recs = [Record::Del { off: 1 }, Record::Pin { off: 2, pin: true }];
        for r in &recs {
            w.append(r).unwrap();
        }
        w.sync().unwrap();
        let whole = std::fs::metadata(&path).unwrap().len();
        let third = format::encode_record(&Record::Del { off: 3 });
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(&third[..third.len() - 1])
            .unwrap();
        assert_eq!(read_log(&path).unwrap(), recs);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), whole);
    }

    #[test]
    fn a_checkpoint_replaces_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.wal");
        let mut w = Wal::new(Box::new(
            FileSink::open(&path, Durability::EachRecord).unwrap(),
        ));
        w.append(&Record::Del { off: 1 }).unwrap();
        assert_eq!(w.since_checkpoint, 1);
        w.checkpoint(&[Record::Pin { off: 5, pin: false }]).unwrap();
        assert_eq!(w.since_checkpoint, 0);
        w.append(&Record::Del { off: 5 }).unwrap();
        assert_eq!(
            read_log(&path).unwrap(),
            [Record::Pin { off: 5, pin: false }, Record::Del { off: 5 }]
        );
    }
}
