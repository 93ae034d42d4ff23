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

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use maru::fuse_record::{self, Record, Server};

/// Where fusectl shows each FUSE connection.
const FUSECTL: &str = "/sys/fs/fuse/connections";

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
        let start = fuse_record::start_time(pid).context("reading this process's start time")?;
        std::fs::create_dir_all(state_dir)?;
        let path = fuse_record::path(state_dir);
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
    let _ = std::fs::remove_file(fuse_record::path(state_dir));
}

/// Ends the FUSE connection of the marud that last served a mount with this state directory,
/// if that process is dying but cannot finish (see the module's comment), and waits (up to
/// `wait`) for it to be gone. Runs at start, before the pools are opened: the dying process
/// still holds their locks. A predecessor alive and well is left alone (the pools' locks and
/// the mount point then refuse this start, each with its own message).
pub fn end_predecessor(state_dir: &Path, wait: Duration) -> anyhow::Result<()> {
    let r = match Record::read(state_dir) {
        None => return Ok(()),
        Some(Ok(r)) => r,
        Some(Err(text)) => {
            tracing::warn!(text, "ignoring an unreadable FUSE connection record");
            forget(state_dir);
            return Ok(());
        }
    };
    match r.server() {
        Server::Gone => {
            forget(state_dir);
            return Ok(());
        }
        Server::Alive => return Ok(()),
        Server::Dying => {}
    }
    let same = || fuse_record::start_time(r.pid) == Some(r.start);
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
