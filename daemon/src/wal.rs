//! Write-ahead log of a pool's metadata (a raw pool's entries, a memfs pool's packs), kept in
//! the state directory: the file and the writer. The records and their framing are
//! `maru::format`'s (doc/POOL-FORMAT.md).
//!
//! Reading stops at the first record that is short, fails its checksum or does not parse (a
//! torn tail after a crash) and truncates the log there.
//!
//! The log rewrites itself once the records appended since its last rewrite reach
//! [`REWRITE_AFTER`] plus four per record that rewrite left (so each record appended pays a
//! bounded share). A rewrite is made on a thread of its own, off the store's lock: it reads
//! the log's bytes as they were when it began, replays them into the live records (what
//! recovery would find) and writes those to a temporary file beside the log (synced unless
//! the log's durability is [`Durability::Process`]). The writer then appends to it the
//! records appended meanwhile and renames it over the log, at its next append. Replaying the
//! live records then the records after them gives what replaying the whole log gives, and a
//! crash before the rename leaves the whole log. At recovery the log is rewritten at once as
//! the entries kept ([`Wal::checkpoint`]).
//!
//! With `--wal-sync` ([`Durability::EachRecord`]) a record is written under the store's
//! lock and synced after it, by the [`Syncer`]: the store takes what its critical section
//! appended ([`Wal::take_unsynced`]) as it lets go of the lock and waits for it
//! ([`Unsynced::wait`]) before it answers. Records waiting at the same moment share one
//! `fdatasync` (a group commit). Only a rewrite's swap syncs under the lock: the records
//! appended while the rewrite ran go into the new file, which must hold them before it
//! replaces the log (once per [`REWRITE_AFTER`] records).
//!
//! Writes go through [`LogSink`] so tests can stop the log after the Nth write
//! and check recovery from every such point.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use maru::format;

/// Records appended after which a log is rewritten, beyond four per record its last rewrite
/// left.
pub const REWRITE_AFTER: u64 = 16_384;

/// Where log bytes go: the seam for crash injection.
pub trait LogSink: Send {
    /// Appends bytes.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Makes appended bytes durable.
    fn sync(&mut self) -> io::Result<()>;
    /// Atomically replaces the whole log with `bytes` (checkpoint).
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Bytes in the log.
    fn size(&self) -> u64;
    /// The log's file (read by a rewrite, which writes its output beside it) and durability.
    fn file(&self) -> (&Path, Durability);
    /// Replaces the log with the rewrite at `tmp` (of the log's first `upto` bytes), after
    /// appending to it the log's bytes from `upto` on.
    fn swap(&mut self, tmp: &Path, upto: u64) -> io::Result<()>;
    /// What is appended and not yet known to be synced, if the log syncs each record after
    /// the store's lock ([`Durability::EachRecord`]).
    fn unsynced(&self) -> Option<Unsynced> {
        None
    }
}

/// Syncs a log's records after the store's lock (`--wal-sync`): whoever waits first syncs
/// everything written so far; those who come meanwhile wait for that sync, or the next.
pub struct Syncer {
    state: Mutex<SyncState>,
    done: Condvar,
    /// Bytes ever appended to the log that are synced (counted across rewrites).
    durable: AtomicU64,
}

struct SyncState {
    /// The log's file now (a rewrite's swap replaces it).
    file: Arc<File>,
    /// Bytes ever appended to the log (across rewrites).
    written: u64,
    /// Bumped when the file is replaced: a sync of the old one then proves nothing.
    generation: u64,
    syncing: bool,
    /// A sync failed: the log's durability is unknown from then on, and nothing is appended.
    failed: Option<String>,
}

impl Syncer {
    fn new(file: Arc<File>, written: u64) -> Syncer {
        Syncer {
            state: Mutex::new(SyncState {
                file,
                written,
                generation: 0,
                syncing: false,
                failed: None,
            }),
            done: Condvar::new(),
            durable: AtomicU64::new(written),
        }
    }

    /// Bytes ever appended that are synced.
    pub fn durable(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }

    /// Refuses an append once a sync failed.
    fn check(&self) -> io::Result<()> {
        match &self.state.lock().failed {
            Some(e) => Err(io::Error::other(format!(
                "the log could not be synced earlier ({e}): nothing more is written to it"
            ))),
            None => Ok(()),
        }
    }

    /// The log can no longer be synced (`why`): waiters and appends fail from now on.
    fn fail(&self, why: String) {
        self.state.lock().failed.get_or_insert(why);
        self.done.notify_all();
    }

    /// Bytes up to `written` are appended (not yet synced).
    fn wrote(&self, written: u64) {
        self.state.lock().written = written;
    }

    /// The file was replaced by `file`, holding every byte appended so far, synced.
    fn replaced(&self, file: Arc<File>, written: u64) {
        let mut st = self.state.lock();
        st.file = file;
        st.written = written;
        st.generation += 1;
        self.durable.fetch_max(written, Ordering::AcqRel);
        self.done.notify_all();
    }

    /// Returns once the bytes up to `upto` are synced (syncing them, and whatever else is
    /// written by then, if no sync under way will).
    pub fn sync_to(&self, upto: u64) -> io::Result<()> {
        crate::store::assert_unlocked("a wait for the log's sync");
        let mut st = self.state.lock();
        loop {
            if let Some(e) = &st.failed {
                return Err(io::Error::other(e.clone()));
            }
            if self.durable() >= upto {
                return Ok(());
            }
            if st.syncing {
                self.done.wait(&mut st);
                continue;
            }
            st.syncing = true;
            let (file, target, generation) = (st.file.clone(), st.written, st.generation);
            let r = parking_lot::MutexGuard::unlocked(&mut st, || file.sync_data());
            st.syncing = false;
            match r {
                Ok(()) if st.generation == generation => {
                    self.durable.fetch_max(target, Ordering::AcqRel);
                }
                Ok(()) => {} // the file was replaced meanwhile, synced: see the loop's top
                Err(e) => st.failed = Some(e.to_string()),
            }
            self.done.notify_all();
        }
    }
}

/// What a critical section of the store appended to a log that syncs each record, to be
/// synced before its verb answers.
#[derive(Clone)]
pub struct Unsynced {
    syncer: Arc<Syncer>,
    upto: u64,
}

impl Unsynced {
    /// Waits until those records are synced.
    pub fn wait(&self) -> io::Result<()> {
        self.syncer.sync_to(self.upto)
    }

    /// Whether they are synced already.
    pub fn synced(&self) -> bool {
        self.syncer.durable() >= self.upto
    }

    /// Bytes ever appended up to the end of these records.
    pub fn upto(&self) -> u64 {
        self.upto
    }
}

/// What a log's writes wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Every record is synced (`--wal-sync`).
    EachRecord,
    /// A rewrite is synced before it replaces the log: a raw pool's log, whose pool (a file, a
    /// device) may outlive the host's memory.
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
    file: Arc<File>,
    durability: Durability,
    len: u64,
    /// Bytes ever appended (across rewrites).
    appended: u64,
    /// The log was renamed since the directory was last synced.
    dir_dirty: bool,
    /// Syncs each record after the store's lock ([`Durability::EachRecord`]).
    syncer: Option<Arc<Syncer>>,
    /// Why appends are refused: a rewrite renamed over the log and then failed (the log's
    /// file could not be opened again, or its directory not synced).
    broken: Option<String>,
}

impl FileSink {
    /// Opens (creating) the log at `path`.
    pub fn open(path: &Path, durability: Durability) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        let file = Arc::new(file);
        let len = file.metadata()?.len();
        Ok(FileSink {
            path: path.to_owned(),
            len,
            appended: len,
            syncer: (durability == Durability::EachRecord)
                .then(|| Arc::new(Syncer::new(file.clone(), len))),
            broken: None,
            file,
            durability,
            dir_dirty: false,
        })
    }

    /// The log's file was replaced and synced whole (with its directory).
    fn all_synced(&self) {
        if let Some(s) = &self.syncer {
            s.replaced(self.file.clone(), self.appended);
        }
    }

    /// Syncs the log's directory if the log was renamed since: a sync of the log then holds
    /// across a crash (before it, a crash leaves the log that was renamed over, whole).
    fn sync_dir(&mut self) -> io::Result<()> {
        if self.dir_dirty
            && let Some(dir) = self.path.parent()
        {
            File::open(dir)?.sync_all()?;
        }
        self.dir_dirty = false;
        Ok(())
    }

    /// Makes the file at `from` (renamed over the log) the log.
    fn renamed(&mut self, from: &Path) -> io::Result<()> {
        std::fs::rename(from, &self.path)?;
        self.dir_dirty = true;
        let new = OpenOptions::new()
            .append(true)
            .read(true)
            .open(&self.path)
            .and_then(|f| Ok((f.metadata()?.len(), f)));
        let (len, new) = self.or_broken(new)?;
        let old = std::mem::replace(&mut self.file, Arc::new(new));
        // The log renamed over goes with its last descriptor, and freeing its pages took
        // 7 ms at 98,304 records: on a thread, not under the store's lock.
        let _ = std::thread::Builder::new()
            .name("maru-wal".into())
            .spawn(move || drop(old));
        self.len = len;
        Ok(())
    }

    /// Fails every wait for this log's sync from now on, as a failed `fdatasync` does (the
    /// daemon's tests).
    #[cfg(feature = "seams")]
    pub fn fail_syncs(&self, why: &str) {
        if let Some(s) = &self.syncer {
            s.fail(why.to_owned());
        }
    }

    /// `r`, which failed after a rewrite was renamed over the log, if it did: what the log's
    /// descriptor or the last sync say no longer holds, so appends are refused from then on
    /// (and with `--wal-sync`, every wait for a sync fails).
    fn or_broken<T>(&mut self, r: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &r {
            let why = format!("the log's rewrite failed after its rename: {e}");
            if let Some(s) = &self.syncer {
                s.fail(why.clone());
            }
            self.broken = Some(why);
        }
        r
    }
}

impl LogSink for FileSink {
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        if let Some(why) = &self.broken {
            return Err(io::Error::other(format!(
                "{why}: nothing more is written to it"
            )));
        }
        if let Some(s) = &self.syncer {
            s.check()?;
        }
        (&*self.file).write_all(bytes)?;
        self.len += bytes.len() as u64;
        self.appended += bytes.len() as u64;
        if let Some(s) = &self.syncer {
            // Synced after the store's lock (`Unsynced`).
            s.wrote(self.appended);
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()?;
        self.sync_dir()?;
        self.all_synced();
        Ok(())
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        let tmp = rewrite_path(&self.path);
        {
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            if self.durability != Durability::Process {
                f.sync_all()?;
            }
        }
        self.renamed(&tmp)?;
        if self.durability != Durability::Process {
            let synced = self.sync_dir();
            self.or_broken(synced)?;
        }
        self.all_synced();
        Ok(())
    }

    fn size(&self) -> u64 {
        self.len
    }

    fn file(&self) -> (&Path, Durability) {
        (&self.path, self.durability)
    }

    fn swap(&mut self, tmp: &Path, upto: u64) -> io::Result<()> {
        let mut tail = vec![0; (self.len - upto) as usize];
        self.file.read_exact_at(&mut tail, upto)?;
        let mut f = OpenOptions::new().append(true).open(tmp)?;
        f.write_all(&tail)?;
        if self.durability == Durability::EachRecord {
            // Those records were durable in the log renamed over.
            f.sync_data()?;
        }
        self.renamed(tmp)?;
        if self.durability == Durability::EachRecord {
            let synced = self.sync_dir();
            self.or_broken(synced)?;
        }
        self.all_synced();
        Ok(())
    }

    fn unsynced(&self) -> Option<Unsynced> {
        let syncer = self.syncer.clone()?;
        (syncer.durable() < self.appended).then_some(Unsynced {
            syncer,
            upto: self.appended,
        })
    }
}

/// Bytes of the log a rewrite reads at a time.
const PIECE: u64 = 4 << 20;
/// More than any record takes (names are at most 4 KiB, escaped at most sixfold).
const MAX_RECORD: u64 = 64 << 10;

/// Where a rewrite of the log at `log` is written before it replaces it.
fn rewrite_path(log: &Path) -> PathBuf {
    log.with_extension("wal.tmp")
}

/// A rewrite of the log's first `upto` bytes (open as `log`) into the live records, at
/// `tmp`; returns how many records it holds. The log is read `piece` bytes at a time: only
/// the live records are held whole.
fn rewrite(
    log: &File,
    upto: u64,
    tmp: &Path,
    durability: Durability,
    piece: u64,
) -> io::Result<u64> {
    let mut live = std::collections::BTreeMap::new();
    let mut buf = Vec::new();
    let mut at = 0;
    while at < upto {
        let n = piece.min(upto - at);
        let old = buf.len();
        buf.resize(old + n as usize, 0);
        log.read_exact_at(&mut buf[old..], at)?;
        at += n;
        let (recs, valid) = format::decode_records(&buf);
        recs.into_iter().for_each(|r| format::apply(&mut live, r));
        // A record cut by the piece's end is decoded with the next piece.
        buf.drain(..valid);
        if buf.len() as u64 >= piece.max(MAX_RECORD) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "no valid record at byte {} of the log",
                    at - buf.len() as u64
                ),
            ));
        }
    }
    if !buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the log's first {upto} bytes do not end on a record ({} bytes over)",
                buf.len()
            ),
        ));
    }
    let mut out = Vec::new();
    for r in live.values() {
        out.extend_from_slice(&format::encode_record(r));
    }
    let mut f = File::create(tmp)?;
    f.write_all(&out)?;
    if durability != Durability::Process {
        f.sync_all()?;
    }
    Ok(live.len() as u64)
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
    /// Records appended since the last rewrite began.
    since: u64,
    /// Records the last rewrite left.
    kept: u64,
    /// A rewrite on its thread.
    rewriting: Option<Rewriting>,
    /// Records were appended since [`Wal::take_unsynced`] last ran.
    untaken: bool,
}

/// A rewrite under way.
struct Rewriting {
    /// The log's bytes it covers.
    upto: u64,
    /// Where it writes.
    tmp: PathBuf,
    /// Its thread; the outcome is how many records it holds.
    thread: JoinHandle<io::Result<u64>>,
}

impl Wal {
    /// Wraps a sink.
    pub fn new(sink: Box<dyn LogSink>) -> Self {
        Wal {
            sink,
            since: 0,
            kept: 0,
            rewriting: None,
            untaken: false,
        }
    }

    /// What was appended since this was last asked and is not yet synced (`--wal-sync`):
    /// the store asks as it lets go of its lock, and waits for it before answering.
    pub fn take_unsynced(&mut self) -> Option<Unsynced> {
        std::mem::take(&mut self.untaken)
            .then(|| self.sink.unsynced())
            .flatten()
    }

    /// The end of what was appended, while it is not yet synced.
    pub fn unsynced(&self) -> Option<Unsynced> {
        self.sink.unsynced()
    }

    /// Appends one record; takes a finished rewrite in, or starts one when it is due.
    pub fn append(&mut self, r: &format::Record) -> io::Result<()> {
        self.sink.append(&format::encode_record(r))?;
        self.untaken = true;
        self.since += 1;
        if self
            .rewriting
            .as_ref()
            .is_some_and(|r| r.thread.is_finished())
        {
            self.finish_rewrite();
        } else if self.rewriting.is_none() && self.since >= REWRITE_AFTER + 4 * self.kept {
            self.start_rewrite();
        }
        Ok(())
    }

    /// Starts rewriting the log on a thread of its own (see the module's documentation).
    fn start_rewrite(&mut self) {
        let upto = self.sink.size();
        let (path, durability) = self.sink.file();
        let tmp = rewrite_path(path);
        let started = File::open(path).and_then(|log| {
            let to = tmp.clone();
            std::thread::Builder::new()
                .name("maru-wal".into())
                .spawn(move || rewrite(&log, upto, &to, durability, PIECE))
        });
        match started {
            Ok(thread) => {
                self.rewriting = Some(Rewriting { upto, tmp, thread });
            }
            Err(e) => tracing::warn!(log = %path.display(), "starting the log's rewrite: {e}"),
        }
        // Counted from here, so that a rewrite that fails is tried again only after as many
        // appends.
        self.since = 0;
    }

    /// Waits for the rewrite under way, if any, and puts it in the log's place.
    fn finish_rewrite(&mut self) {
        let Some(rw) = self.rewriting.take() else {
            return;
        };
        let r = rw
            .thread
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the rewrite's thread panicked")))
            .and_then(|kept| self.sink.swap(&rw.tmp, rw.upto).map(|()| kept));
        match r {
            Ok(kept) => self.kept = kept,
            Err(e) => {
                // The log stays whole, unless this failed after the rename (then it takes no
                // more appends: `FileSink::or_broken`).
                tracing::warn!(log = %self.sink.file().0.display(), "rewriting the log: {e}");
                let _ = std::fs::remove_file(&rw.tmp);
            }
        }
    }

    /// Rewrites the log as `live` now (recovery), after any rewrite under way.
    pub fn checkpoint(&mut self, live: &[format::Record]) -> io::Result<()> {
        self.finish_rewrite();
        let mut bytes = Vec::new();
        for r in live {
            bytes.extend_from_slice(&format::encode_record(r));
        }
        self.sink.replace(&bytes)?;
        self.since = 0;
        self.kept = live.len() as u64;
        Ok(())
    }

    /// Syncs the log.
    pub fn sync(&mut self) -> io::Result<()> {
        self.sink.sync()
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.finish_rewrite();
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
        assert_eq!(w.since, 1);
        w.checkpoint(&[Record::Pin { off: 5, pin: false }]).unwrap();
        assert_eq!((w.since, w.kept), (0, 1));
        w.append(&Record::Del { off: 5 }).unwrap();
        assert_eq!(
            read_log(&path).unwrap(),
            [Record::Pin { off: 5, pin: false }, Record::Del { off: 5 }]
        );
    }

    /// With `--wal-sync` an append syncs nothing: what a critical section appended is taken
    /// once, and synced by whoever waits for it first (with what others appended by then);
    /// a rewrite's swap leaves everything synced.
    #[test]
    fn each_record_is_synced_after_the_append_by_its_first_waiter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.wal");
        let mut w = Wal::new(Box::new(
            FileSink::open(&path, Durability::EachRecord).unwrap(),
        ));
        assert!(w.take_unsynced().is_none(), "nothing appended");
        w.append(&seal(1)).unwrap();
        let first = w.take_unsynced().expect("appended, not synced");
        assert!(!first.synced());
        assert!(w.take_unsynced().is_none(), "taken once");
        w.append(&seal(2)).unwrap();
        let second = w.take_unsynced().expect("appended, not synced");
        assert!(second.upto() > first.upto());
        // The second's waiter syncs both; the first's finds its records synced.
        second.wait().unwrap();
        assert!(first.synced() && second.synced());
        first.wait().unwrap();
        assert!(w.unsynced().is_none());
        // Many waiters at once: each returns once its records are synced.
        let waits: Vec<Unsynced> = (3..11)
            .map(|i| {
                w.append(&seal(i)).unwrap();
                w.take_unsynced().unwrap()
            })
            .collect();
        std::thread::scope(|s| {
            for u in &waits {
                s.spawn(|| {
                    u.wait().unwrap();
                    assert!(u.synced());
                });
            }
        });
        // A rewrite's swap (here a checkpoint) syncs the new log whole.
        w.append(&seal(11)).unwrap();
        w.checkpoint(&[seal(11)]).unwrap();
        assert!(w.take_unsynced().is_none_or(|u| u.synced()));
        // Without `--wal-sync` nothing is ever waited for.
        let mut w = Wal::new(Box::new(
            FileSink::open(&dir.path().join("other.wal"), Durability::Checkpoints).unwrap(),
        ));
        w.append(&seal(1)).unwrap();
        assert!(w.take_unsynced().is_none());
    }

    /// A rewrite that fails after its rename (the log's file not opened again, or its
    /// directory not synced): the log takes no more appends, and waits for its sync fail.
    #[test]
    fn a_rewrite_failing_after_its_rename_stops_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink =
            FileSink::open(&dir.path().join("pool.wal"), Durability::EachRecord).unwrap();
        sink.append(b"record").unwrap();
        let waiting = sink.unsynced().expect("appended, not synced");
        let failed = sink.or_broken::<()>(Err(io::Error::other("injected")));
        assert!(failed.is_err());
        let refused = sink.append(b"more").unwrap_err().to_string();
        assert!(refused.contains("injected"), "{refused}");
        assert!(
            waiting.wait().is_err(),
            "a record nothing synced is not durable"
        );
    }

    fn seal(off: u64) -> Record {
        Record::Seal {
            ns: "ns".into(),
            key: format!("k{off}"),
            off,
            size: 1,
            asize: 4096,
            pin: false,
            uid: 0,
            gid: 0,
        }
    }

    /// Appends enough records to start a rewrite, and more while it runs; returns them all.
    fn churn(w: &mut Wal) -> Vec<Record> {
        let mut all = Vec::new();
        let mut push = |w: &mut Wal, r: Record| {
            w.append(&r).unwrap();
            all.push(r);
        };
        for off in 0..REWRITE_AFTER {
            push(w, seal(off));
            if off % 3 == 0 {
                push(w, Record::Del { off });
            }
        }
        // Appended while the rewrite may still run: carried over into the rewritten log.
        for off in 0..64 {
            push(w, Record::Del { off: off * 3 + 1 });
            push(
                w,
                Record::Pin {
                    off: off * 3 + 2,
                    pin: true,
                },
            );
            push(
                w,
                Record::Rename {
                    off: off * 3 + 2,
                    ns: "other".into(),
                    key: format!("r{off}"),
                },
            );
        }
        push(w, seal(1 << 40));
        all
    }

    #[test]
    fn a_rewrite_off_the_writer_keeps_what_replaying_the_whole_log_finds() {
        for durability in [
            Durability::Process,
            Durability::Checkpoints,
            Durability::EachRecord,
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("pool.wal");
            let mut w = Wal::new(Box::new(FileSink::open(&path, durability).unwrap()));
            let all = churn(&mut w);
            assert!(w.rewriting.is_some() || w.kept > 0, "a rewrite began");
            drop(w); // takes the rewrite in
            let logged = read_log(&path).unwrap();
            assert_eq!(
                format::replay(logged.clone()),
                format::replay(all.clone()),
                "{durability:?}"
            );
            // A third of the seals before the rewrite were deleted: those records are gone.
            assert!(
                logged.len() * 10 < all.len() * 7,
                "{durability:?}: the log was rewritten ({} of {} records)",
                logged.len(),
                all.len()
            );
            assert!(!rewrite_path(&path).exists(), "{durability:?}");
            // Records go on after the rewritten log.
            let mut w = Wal::new(Box::new(FileSink::open(&path, durability).unwrap()));
            w.append(&Record::Del { off: 1 << 40 }).unwrap();
            drop(w);
            assert_eq!(read_log(&path).unwrap().len(), logged.len() + 1);
        }
    }

    #[test]
    fn a_failed_rewrite_leaves_the_whole_log_and_is_tried_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.wal");
        // The rewrite cannot create its file.
        std::fs::create_dir(rewrite_path(&path)).unwrap();
        let mut w = Wal::new(Box::new(
            FileSink::open(&path, Durability::Checkpoints).unwrap(),
        ));
        let mut all = churn(&mut w);
        w.finish_rewrite();
        assert_eq!(read_log(&path).unwrap(), all, "the log is whole");
        assert_eq!(w.kept, 0);
        // Tried again once as many records were appended, and this time it takes.
        std::fs::remove_dir(rewrite_path(&path)).unwrap();
        let mut n = 0;
        while w.kept == 0 {
            let r = seal(2 << 40 | n);
            w.append(&r).unwrap();
            all.push(r);
            n += 1;
            assert!(n <= REWRITE_AFTER + 1, "no rewrite again");
            if w.rewriting.is_some() {
                w.finish_rewrite();
            }
        }
        assert!(n > REWRITE_AFTER / 2, "not retried at once: {n}");
        drop(w);
        assert_eq!(
            format::replay(read_log(&path).unwrap()),
            format::replay(all)
        );
    }

    #[test]
    fn a_rewrite_reads_the_log_in_pieces_and_refuses_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.wal");
        let mut sink = FileSink::open(&path, Durability::Process).unwrap();
        let mut all = Vec::new();
        for off in 0..500 {
            all.push(seal(off));
            all.push(Record::Pin {
                off: off / 2,
                pin: true,
            });
            if off % 7 == 0 {
                all.push(Record::Del { off: off / 3 });
            }
        }
        for r in &all {
            sink.append(&format::encode_record(r)).unwrap();
        }
        let log = File::open(&path).unwrap();
        let tmp = dir.path().join("out");
        for piece in [1, 37, 4096, PIECE] {
            let n = rewrite(&log, sink.size(), &tmp, Durability::Process, piece).unwrap();
            let out = read_log(&tmp).unwrap();
            assert_eq!(n as usize, out.len(), "piece {piece}");
            assert_eq!(
                format::replay(out),
                format::replay(all.clone()),
                "piece {piece}"
            );
        }
        // Bytes that are no record, then records: refused, not skipped over.
        sink.append(&[7; 100]).unwrap();
        sink.append(&format::encode_record(&seal(9999))).unwrap();
        let e = rewrite(&log, sink.size(), &tmp, Durability::Process, 64).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }
}
