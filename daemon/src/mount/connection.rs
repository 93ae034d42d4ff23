//! The mount's FUSE connection, written down so that the next marud can end it when the
//! process that served it died and cannot finish dying.
//!
//! A marud killed (SIGKILL, the OOM killer) while one of its threads sits in the kernel on an
//! invalidation of a cached name (`FUSE_NOTIFY_INVAL_ENTRY` and `FUSE_NOTIFY_DELETE` take the
//! directory's lock, uninterruptibly) never finishes exiting when a client's request holds that
//! lock waiting for an answer: the thread waits for the lock, the request waits for an answer
//! the dead daemon will not give, and the kernel aborts the connection (answering every request
//! with ENOTCONN) only once the last descriptor of `/dev/fuse` closes — at the end of the very
//! exit that is waiting. Clients of the mount hang, and so does a restart that needs the pool's
//! lock the dying process still holds. The kernel's way out is writing to the connection's
//! `abort` file under fusectl (`/sys/fs/fuse/connections/<id>/abort`); marud does it at start
//! for its predecessor, which it finds in the record made here at mount time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

/// Where fusectl shows each FUSE connection.
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// The record's file in the state directory.
fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join("fuse-connection")
}

/// Who served which connection: the daemon's pid and start time (in clock ticks after boot,
/// so that a pid used again names no other process) and the connection's id under fusectl.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    pid: u32,
    start: u64,
    conn: u32,
}

impl Record {
    fn parse(s: &str) -> Option<Record> {
        let mut pid = None;
        let mut start = None;
        let mut conn = None;
        for field in s.split_whitespace() {
            let (k, v) = field.split_once('=')?;
            match k {
                "pid" => pid = v.parse().ok(),
                "start" => start = v.parse().ok(),
                "conn" => conn = v.parse().ok(),
                _ => {}
            }
        }
        Some(Record {
            pid: pid?,
            start: start?,
            conn: conn?,
        })
    }

    fn text(&self) -> String {
        format!("pid={} start={} conn={}\n", self.pid, self.start, self.conn)
    }
}

/// The connection id fusectl gives the FUSE mount at `dir` (the kernel's device number of its
/// superblock: `major << 20 | minor`), read from this process's mount table.
fn connection_of(dir: &Path) -> Option<u32> {
    let m = crate::pool::mount_entry(dir)?;
    m.fstype
        .starts_with("fuse")
        .then_some((m.dev.0 << 20) | m.dev.1)
}

/// Writes down that this process serves the mount at `dir` (after mounting it). A failure is
/// a warning: the mount works without it, only a stuck predecessor would need a hand.
pub(crate) fn record(state_dir: &Path, dir: &Path) {
    let r = (|| -> anyhow::Result<()> {
        let conn = connection_of(dir).context("the mount is not in the mount table")?;
        let pid = std::process::id();
        let start = start_time(pid).context("reading this process's start time")?;
        std::fs::create_dir_all(state_dir)?;
        let path = record_path(state_dir);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, Record { pid, start, conn }.text())?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    })();
    if let Err(e) = r {
        tracing::warn!("cannot record the mount's FUSE connection: {e:#}");
    }
}

/// Forgets the record (the mount was taken down in order).
pub(crate) fn forget(state_dir: &Path) {
    let _ = std::fs::remove_file(record_path(state_dir));
}

/// A process's start time (field 22 of `/proc/PID/stat`), None when it does not exist.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` is on its way out: its main thread has exited (a zombie waiting for
/// the others) or a SIGKILL is pending for one of its threads.
fn dying(pid: u32) -> bool {
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().next().map(str::to_owned)
        });
    if matches!(state.as_deref(), Some("Z" | "X")) {
        return true;
    }
    let pending = |status: &str, field: &str| -> bool {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|m| m & SIGKILL_BIT != 0)
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("status"))
            .is_ok_and(|s| pending(&s, "SigPnd:") || pending(&s, "ShdPnd:"))
    })
}

/// Ends the FUSE connection of the marud that last served a mount with this state directory,
/// if that process is dying but cannot finish (see the module's comment), and waits (up to
/// `wait`) for it to be gone. Runs at start, before the pools are opened: the dying process
/// still holds their locks. A predecessor alive and well is left alone (the pools' locks and
/// the mount point then refuse this start, each with its own message).
pub fn end_predecessor(state_dir: &Path, wait: Duration) -> anyhow::Result<()> {
    let path = record_path(state_dir);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let Some(r) = Record::parse(&text) else {
        tracing::warn!(file = %path.display(), "ignoring an unreadable FUSE connection record");
        forget(state_dir);
        return Ok(());
    };
    let same = || start_time(r.pid) == Some(r.start);
    if !same() {
        // Gone: its exit ended the connection.
        forget(state_dir);
        return Ok(());
    }
    if !dying(r.pid) {
        return Ok(());
    }
    // Give an ordinary exit a moment first: most end by themselves.
    let t = Instant::now();
    while same() && t.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(20));
    }
    if !same() {
        forget(state_dir);
        return Ok(());
    }
    tracing::warn!(
        pid = r.pid,
        connection = r.conn,
        "the previous marud is stuck in its exit with its FUSE connection open: aborting it"
    );
    abort(r.conn)?;
    let t = Instant::now();
    while same() {
        if t.elapsed() > wait {
            anyhow::bail!(
                "the previous marud (pid {}) did not exit within {wait:?} of its FUSE \
                 connection's abort",
                r.pid
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    forget(state_dir);
    tracing::info!(pid = r.pid, "the previous marud has exited");
    Ok(())
}

/// Writes to connection `conn`'s `abort` file, mounting fusectl for the moment if it is not.
fn abort(conn: u32) -> anyhow::Result<()> {
    let ctl = Path::new(FUSECTL);
    let mounted = crate::pool::mount_entry(ctl).is_some_and(|m| m.fstype == "fusectl");
    if !mounted {
        nix::mount::mount(
            Some("fusectl"),
            ctl,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("mounting fusectl on {FUSECTL}"))?;
    }
    let file = ctl.join(conn.to_string()).join("abort");
    let r = std::fs::write(&file, b"1");
    if !mounted {
        let _ = nix::mount::umount2(ctl, nix::mount::MntFlags::MNT_DETACH);
    }
    match r {
        // The connection ended meanwhile.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r.with_context(|| format!("writing {}", file.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_a_torn_one_is_refused() {
        let r = Record {
            pid: 42,
            start: 123_456,
            conn: 44,
        };
        assert_eq!(Record::parse(&r.text()), Some(r));
        assert_eq!(Record::parse("pid=42 start=123456"), None);
        assert_eq!(Record::parse("pid=42 start=x conn=44"), None);
        assert_eq!(Record::parse(""), None);
    }

    #[test]
    fn this_process_is_alive_and_not_dying() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert!(!dying(me));
        assert_eq!(start_time(u32::MAX), None);
    }
}
