//! Write-ahead log of a raw pool's metadata, kept in the state directory.
//!
//! A record is `u32 len (LE) | u32 crc32 (LE) | len bytes of JSON`. Replay stops
//! at the first record that is short or fails its checksum (a torn tail after a
//! crash) and truncates the log there. A checkpoint rewrites the log as one
//! `Seal` record per live entry (written to a temporary file, synced, renamed).
//!
//! Writes go through [`LogSink`] so tests can stop the log after the Nth write
//! and check recovery from every such point.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One metadata change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum Record {
    /// An entry was sealed at `off`.
    Seal {
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
        /// Offset in the pool.
        off: u64,
        /// Bytes of data.
        size: u64,
        /// Bytes reserved (4 KiB multiple).
        asize: u64,
        /// Pinned.
        pin: bool,
        /// Owner uid.
        #[serde(default)]
        uid: u32,
        /// Owner gid.
        #[serde(default)]
        gid: u32,
    },
    /// The entry at `off` was deleted or evicted.
    Del {
        /// Offset in the pool.
        off: u64,
    },
    /// The entry at `off` was pinned or unpinned.
    Pin {
        /// Offset in the pool.
        off: u64,
        /// New state.
        pin: bool,
    },
    /// The entry at `off` was renamed.
    Rename {
        /// Offset in the pool.
        off: u64,
        /// New namespace.
        ns: String,
        /// New key.
        key: String,
    },
}

/// Where log bytes go: the seam for crash injection.
pub trait LogSink: Send {
    /// Appends bytes.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Makes appended bytes durable.
    fn sync(&mut self) -> io::Result<()>;
    /// Atomically replaces the whole log with `bytes` (checkpoint).
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()>;
}

/// The log file in the state directory.
pub struct FileSink {
    path: PathBuf,
    file: File,
    sync_each: bool,
}

impl FileSink {
    /// Opens (creating) the log at `path`.
    pub fn open(path: &Path, sync_each: bool) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        Ok(FileSink {
            path: path.to_owned(),
            file,
            sync_each,
        })
    }
}

impl LogSink for FileSink {
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all(bytes)?;
        if self.sync_each {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        let tmp = self.path.with_extension("wal.tmp");
        {
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        self.file = OpenOptions::new()
            .append(true)
            .read(true)
            .open(&self.path)?;
        Ok(())
    }
}

/// Encodes one record.
pub fn encode(r: &Record) -> Vec<u8> {
    let body = serde_json::to_vec(r).expect("records serialize");
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes records from a log image; returns them and the length of the valid prefix.
pub fn decode_all(bytes: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().expect("4")) as usize;
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().expect("4"));
        let Some(body) = bytes.get(pos + 8..pos + 8 + len) else {
            break;
        };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Ok(r) = serde_json::from_slice::<Record>(body) else {
            break;
        };
        out.push(r);
        pos += 8 + len;
    }
    (out, pos)
}

/// Reads a log file, truncating a torn tail. A missing file is an empty log.
pub fn read_log(path: &Path) -> io::Result<Vec<Record>> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    }
    let (recs, valid) = decode_all(&bytes);
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
    pub fn append(&mut self, r: &Record) -> io::Result<()> {
        self.sink.append(&encode(r))?;
        self.since_checkpoint += 1;
        Ok(())
    }

    /// Rewrites the log as `live`.
    pub fn checkpoint(&mut self, live: &[Record]) -> io::Result<()> {
        let mut bytes = Vec::new();
        for r in live {
            bytes.extend_from_slice(&encode(r));
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

/// Applies records to a map `offset -> Seal record`: the live entries they describe.
pub fn replay(recs: Vec<Record>) -> std::collections::BTreeMap<u64, Record> {
    let mut live = std::collections::BTreeMap::new();
    for r in recs {
        match r {
            Record::Seal { off, .. } => {
                live.insert(off, r);
            }
            Record::Del { off } => {
                live.remove(&off);
            }
            Record::Pin { off, pin } => {
                if let Some(Record::Seal { pin: p, .. }) = live.get_mut(&off) {
                    *p = pin;
                }
            }
            Record::Rename { off, ns, key } => {
                if let Some(Record::Seal { ns: n, key: k, .. }) = live.get_mut(&off) {
                    *n = ns;
                    *k = key;
                }
            }
        }
    }
    live
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seal(off: u64) -> Record {
        Record::Seal {
            ns: "n".into(),
            key: format!("k{off}"),
            off,
            size: 10,
            asize: 4096,
            pin: false,
            uid: 0,
            gid: 0,
        }
    }

    #[test]
    fn torn_tail_is_dropped() {
        let mut bytes = encode(&seal(1));
        bytes.extend(encode(&seal(2)));
        let full = bytes.len();
        bytes.extend(&encode(&seal(3))[..5]);
        let (recs, valid) = decode_all(&bytes);
        assert_eq!(recs.len(), 2);
        assert_eq!(valid, full);
        // A flipped byte ends the log at that record.
        let mut bad = encode(&seal(1));
        bad.extend(encode(&seal(2)));
        let n = bad.len();
        bad[n - 3] ^= 0xff;
        assert_eq!(decode_all(&bad).0.len(), 1);
    }

    #[test]
    fn replay_applies_changes() {
        let recs = vec![
            seal(1),
            seal(2),
            Record::Pin { off: 2, pin: true },
            Record::Del { off: 1 },
            Record::Rename {
                off: 2,
                ns: "m".into(),
                key: "x".into(),
            },
        ];
        let live = replay(recs);
        assert_eq!(live.len(), 1);
        assert_eq!(
            live[&2],
            Record::Seal {
                ns: "m".into(),
                key: "x".into(),
                off: 2,
                size: 10,
                asize: 4096,
                pin: true,
                uid: 0,
                gid: 0,
            }
        );
    }
}
