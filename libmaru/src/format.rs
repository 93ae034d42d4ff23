//! The on-pool formats of raw pools (`devdax:`, `file:`), shared by marud and maructl:
//! the 32-byte device header at offset 0 and the records of the pool's metadata log.
//!
//! doc/POOL-FORMAT.md specifies both byte by byte; the constants here mirror it. Every
//! integer is little-endian.
//!
//! # Version rule
//!
//! [`DEV_VERSION`] is the version of everything a raw pool holds or implies: the header, the
//! layout of regions on the device and the log records. A change that an older marud would
//! misread (a new record kind included: replay stops at a record it cannot parse and
//! truncates the log there) takes a new version. A header whose magic matches but whose
//! version is not [`DEV_VERSION`] is refused ([`HeaderError::UnknownVersion`]), never
//! rewritten.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// Alignment of entries and allocations in a raw pool's regions and in a memfs pack: each
/// takes whole units of it, so that no two share a page and each can be mapped alone.
pub const ENTRY_ALIGN: u64 = 4096;

/// Magic of the raw pool header (bytes 0..8).
pub const DEV_MAGIC: [u8; 8] = *b"MARUDEV\0";
/// The one raw pool format version this build reads and writes (bytes 8..12).
pub const DEV_VERSION: u32 = 1;
/// Size of the header at offset 0 of a raw pool.
pub const DEV_HEADER_LEN: usize = 32;

/// Byte ranges of the header fields (doc/POOL-FORMAT.md).
const MAGIC_AT: std::ops::Range<usize> = 0..8;
const VERSION_AT: std::ops::Range<usize> = 8..12;
const UUID_AT: std::ops::Range<usize> = 12..28;
// Bytes 28..32 are reserved: written as zero, not checked on read.

/// Why a raw pool's header cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// The magic matches but the version is not the one this build knows: a newer (or
    /// unknown) marud formatted the device, and this one must not touch it.
    #[error(
        "pool format version {found} is not supported (this build supports version {supported})"
    )]
    UnknownVersion {
        /// The version in the header.
        found: u32,
        /// The version this build supports ([`DEV_VERSION`]).
        supported: u32,
    },
    /// The header could not be read (a device shorter than the header included).
    #[error("reading the device header")]
    Read(#[source] io::Error),
    /// The header could not be written or synced.
    #[error("writing the device header")]
    Write(#[source] io::Error),
}

/// The header at offset 0 of a raw pool:
/// `magic[8] | version u32 LE | uuid[16] | reserved u32 (0)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevHeader {
    /// Identity of the pool (names its log in the state directory).
    pub uuid: uuid::Uuid,
}

impl DevHeader {
    /// A header of the current version with a fresh (v4) UUID.
    pub fn fresh() -> Self {
        DevHeader {
            uuid: uuid::Uuid::new_v4(),
        }
    }

    /// The format version this header is written with (always [`DEV_VERSION`]: a header of
    /// another version does not decode).
    pub fn version(&self) -> u32 {
        DEV_VERSION
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; DEV_HEADER_LEN] {
        let mut b = [0u8; DEV_HEADER_LEN];
        b[MAGIC_AT].copy_from_slice(&DEV_MAGIC);
        b[VERSION_AT].copy_from_slice(&DEV_VERSION.to_le_bytes());
        b[UUID_AT].copy_from_slice(self.uuid.as_bytes());
        b
    }

    /// Decodes a header: `Ok(None)` when the magic is absent (no maru pool there), an error
    /// when the magic matches but the version is not [`DEV_VERSION`].
    pub fn decode(b: &[u8; DEV_HEADER_LEN]) -> Result<Option<Self>, HeaderError> {
        if b[MAGIC_AT] != DEV_MAGIC {
            return Ok(None);
        }
        let version = u32::from_le_bytes(b[VERSION_AT].try_into().expect("4 bytes"));
        if version != DEV_VERSION {
            return Err(HeaderError::UnknownVersion {
                found: version,
                supported: DEV_VERSION,
            });
        }
        Ok(Some(DevHeader {
            uuid: uuid::Uuid::from_bytes(b[UUID_AT].try_into().expect("16 bytes")),
        }))
    }

    /// The UUID as text (the name of the pool's log: `pool-<uuid>.wal`).
    pub fn uuid_string(&self) -> String {
        self.uuid.to_string()
    }
}

/// Reads the header of a raw pool device or file (see [`DevHeader::decode`]).
pub fn read_header(f: &File) -> Result<Option<DevHeader>, HeaderError> {
    let mut b = [0u8; DEV_HEADER_LEN];
    f.read_exact_at(&mut b, 0).map_err(HeaderError::Read)?;
    DevHeader::decode(&b)
}

/// Writes a new header with a fresh UUID and syncs it.
pub fn init_header(f: &File) -> Result<DevHeader, HeaderError> {
    let h = DevHeader::fresh();
    f.write_all_at(&h.encode(), 0)
        .and_then(|()| f.sync_data())
        .map_err(HeaderError::Write)?;
    Ok(h)
}

/// Zeroes the header and syncs it.
pub fn clear_header(f: &File) -> Result<(), HeaderError> {
    f.write_all_at(&[0u8; DEV_HEADER_LEN], 0)
        .and_then(|()| f.sync_data())
        .map_err(HeaderError::Write)
}

/// Takes the exclusive lock a running marud holds on each raw pool device or file (an
/// `flock` on the open file description, released when its last descriptor closes).
/// Returns false if another process holds it.
pub fn lock_device(f: &File) -> io::Result<bool> {
    try_flock(f, libc::LOCK_EX)
}

/// Takes a shared lock on the device: the hosts of a cluster (marud processes sharing one
/// device) hold it together, and [`lock_device`] (one host's exclusive use) is refused while
/// any of them runs. False when another marud holds it exclusively.
pub fn lock_device_shared(f: &File) -> io::Result<bool> {
    try_flock(f, libc::LOCK_SH)
}

/// `flock(op | LOCK_NB)`: false when another holder conflicts.
fn try_flock(f: &File, op: libc::c_int) -> io::Result<bool> {
    // libc, not nix: nix's only non-deprecated flock API is the owning `Flock<T>`, which
    // unlocks when dropped and cannot hand the `File` back still locked; marud keeps the plain
    // `File` (and its clones) for the life of the pool.
    // SAFETY: plain syscall on a descriptor we own for the duration of the call.
    if unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// One metadata change of a raw pool, as its log records it (the record body is this enum as
/// JSON, tagged by `t`).
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

/// Bytes before a record's body: `u32 len LE | u32 crc32(body) LE`.
pub const RECORD_HEAD_LEN: usize = 8;

/// Frames one record: `u32 len LE | u32 crc32(body) LE | body`, body = the record as JSON.
pub fn encode_record(r: &Record) -> Vec<u8> {
    let body = serde_json::to_vec(r).expect("records serialize");
    let len = u32::try_from(body.len()).expect("a record body is far below 4 GiB");
    let mut out = Vec::with_capacity(body.len() + RECORD_HEAD_LEN);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes the records of a log image, in order, up to the first record that is short, fails
/// its checksum or does not parse (a torn tail after a crash); returns them and the length of
/// the valid prefix (where a writer truncates the log).
pub fn decode_records(bytes: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(head) = bytes.get(pos..pos + RECORD_HEAD_LEN) {
        let len = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
        let start = pos + RECORD_HEAD_LEN;
        let Some(body) = start.checked_add(len).and_then(|end| bytes.get(start..end)) else {
            break;
        };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Ok(r) = serde_json::from_slice::<Record>(body) else {
            break;
        };
        out.push(r);
        pos = start + len;
    }
    (out, pos)
}

/// Applies records in order: the live entries they leave, as `offset -> Seal record`.
pub fn replay(recs: Vec<Record>) -> BTreeMap<u64, Record> {
    let mut live = BTreeMap::new();
    for r in recs {
        apply(&mut live, r);
    }
    live
}

/// Applies one record to the live entries of the records before it ([`replay`]).
pub fn apply(live: &mut BTreeMap<u64, Record>, r: Record) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_bytes_follow_the_spec() {
        let uuid = uuid::Uuid::from_bytes([7; 16]);
        let b = DevHeader { uuid }.encode();
        assert_eq!(&b[0..8], b"MARUDEV\0");
        assert_eq!(&b[8..12], &[1, 0, 0, 0]);
        assert_eq!(&b[12..28], &[7; 16]);
        assert_eq!(&b[28..32], &[0; 4]);
        assert_eq!(DevHeader::decode(&b).unwrap(), Some(DevHeader { uuid }));
    }

    #[test]
    fn no_magic_is_no_header() {
        assert!(DevHeader::decode(&[0; DEV_HEADER_LEN]).unwrap().is_none());
        let mut b = DevHeader::fresh().encode();
        b[0] = b'N';
        assert!(DevHeader::decode(&b).unwrap().is_none());
    }

    #[test]
    fn unknown_version_is_refused() {
        for v in [0u32, 2, u32::MAX] {
            let mut b = DevHeader::fresh().encode();
            b[8..12].copy_from_slice(&v.to_le_bytes());
            match DevHeader::decode(&b) {
                Err(HeaderError::UnknownVersion { found, supported }) => {
                    assert_eq!((found, supported), (v, DEV_VERSION));
                }
                other => panic!("version {v}: {other:?}"),
            }
        }
        let e = HeaderError::UnknownVersion {
            found: 2,
            supported: 1,
        };
        assert_eq!(
            e.to_string(),
            "pool format version 2 is not supported (this build supports version 1)"
        );
    }

    #[test]
    fn header_on_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .unwrap();
        // Shorter than a header: a read error, not "no header".
        assert!(matches!(read_header(&f), Err(HeaderError::Read(_))));
        f.set_len(4 << 20).unwrap();
        assert_eq!(read_header(&f).unwrap(), None);
        let h = init_header(&f).unwrap();
        assert_eq!(read_header(&f).unwrap(), Some(h));
        assert_eq!(h.version(), DEV_VERSION);
        clear_header(&f).unwrap();
        assert_eq!(read_header(&f).unwrap(), None);
    }

    #[test]
    fn the_lock_is_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        let a = File::create(&path).unwrap();
        let b = File::open(&path).unwrap();
        assert!(lock_device(&a).unwrap());
        assert!(!lock_device(&b).unwrap());
        drop(a);
        assert!(lock_device(&b).unwrap());
    }

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
    fn record_bytes_follow_the_spec() {
        let b = encode_record(&Record::Del { off: 4096 });
        let body = br#"{"t":"del","off":4096}"#;
        assert_eq!(&b[0..4], &(body.len() as u32).to_le_bytes());
        assert_eq!(&b[4..8], &crc32fast::hash(body).to_le_bytes());
        assert_eq!(&b[8..], body);
        // uid and gid default to 0 (records written before they existed).
        let old = br#"{"t":"seal","ns":"n","key":"k1","off":1,"size":10,"asize":4096,"pin":false}"#;
        assert_eq!(serde_json::from_slice::<Record>(old).unwrap(), seal(1));
    }

    #[test]
    fn every_record_kind_round_trips() {
        let recs = vec![
            seal(1),
            Record::Del { off: 1 },
            Record::Pin { off: 2, pin: true },
            Record::Rename {
                off: 2,
                ns: "a/b".into(),
                key: "k é".into(),
            },
        ];
        let bytes: Vec<u8> = recs.iter().flat_map(encode_record).collect();
        assert_eq!(decode_records(&bytes), (recs, bytes.len()));
        assert_eq!(decode_records(&[]), (Vec::new(), 0));
    }

    #[test]
    fn torn_tail_is_dropped() {
        let mut bytes = encode_record(&seal(1));
        bytes.extend(encode_record(&seal(2)));
        let full = bytes.len();
        let third = encode_record(&seal(3));
        // Cut anywhere inside the third record: its head or its body.
        for cut in 1..third.len() {
            let mut b = bytes.clone();
            b.extend(&third[..cut]);
            let (recs, valid) = decode_records(&b);
            assert_eq!(recs.len(), 2, "cut at {cut}");
            assert_eq!(valid, full, "cut at {cut}");
        }
    }

    #[test]
    fn corrupt_record_ends_the_log() {
        let mut bad = encode_record(&seal(1));
        let first = bad.len();
        bad.extend(encode_record(&seal(2)));
        bad.extend(encode_record(&seal(3)));
        // A flipped byte in the second record's body: the log ends before it.
        bad[first + RECORD_HEAD_LEN + 3] ^= 0xff;
        assert_eq!(decode_records(&bad), (vec![seal(1)], first));
        // A length that points past the end.
        let mut long = encode_record(&seal(1));
        long[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_records(&long), (Vec::new(), 0));
        // Zeroes (a file extended but never written): no record.
        assert_eq!(decode_records(&[0; 64]), (Vec::new(), 0));
    }

    #[test]
    fn unparsable_body_with_good_checksum_ends_the_log() {
        let mut b = encode_record(&seal(1));
        let valid = b.len();
        for body in [&br#"{"t":"future","off":1}"#[..], b"not json"] {
            let mut c = b.clone();
            c.extend_from_slice(&(body.len() as u32).to_le_bytes());
            c.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
            c.extend_from_slice(body);
            assert_eq!(decode_records(&c), (vec![seal(1)], valid));
        }
        b.truncate(RECORD_HEAD_LEN - 1);
        assert_eq!(decode_records(&b), (Vec::new(), 0));
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
            // Changes to offsets with no live entry are ignored.
            Record::Pin { off: 9, pin: true },
            Record::Rename {
                off: 9,
                ns: "m".into(),
                key: "y".into(),
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

    fn any_record() -> impl Strategy<Value = Record> {
        prop_oneof![
            (
                "[a-z/]{0,12}",
                "[^\u{0}]{0,16}",
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<bool>(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(ns, key, off, size, asize, pin, uid, gid)| Record::Seal {
                    ns,
                    key,
                    off,
                    size,
                    asize,
                    pin,
                    uid,
                    gid
                }),
            any::<u64>().prop_map(|off| Record::Del { off }),
            (any::<u64>(), any::<bool>()).prop_map(|(off, pin)| Record::Pin { off, pin }),
            (any::<u64>(), "[a-z]{0,8}", ".{0,8}").prop_map(|(off, ns, key)| Record::Rename {
                off,
                ns,
                key
            }),
        ]
    }

    proptest! {
        /// Any log cut anywhere decodes to the records wholly before the cut.
        #[test]
        fn a_cut_log_decodes_to_its_whole_records(
            recs in proptest::collection::vec(any_record(), 0..8),
            cut in any::<proptest::sample::Index>(),
        ) {
            let framed: Vec<Vec<u8>> = recs.iter().map(encode_record).collect();
            let bytes: Vec<u8> = framed.concat();
            let cut = cut.index(bytes.len() + 1);
            let mut whole = 0;
            let mut end = 0;
            for f in &framed {
                if end + f.len() > cut {
                    break;
                }
                end += f.len();
                whole += 1;
            }
            let (got, valid) = decode_records(&bytes[..cut]);
            prop_assert_eq!(&got[..], &recs[..whole]);
            prop_assert_eq!(valid, end);
        }
    }
}
