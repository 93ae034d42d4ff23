//! Runs the `/maru` filesystem in-process over the store.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use maru_fsd::fs::Fs;
use maru_fsd::fuse::FuseFs;
use maru_fsd::ring::{Rings, UringMode};

use crate::store::fsview::StoreFs;
use crate::store::{Invalidation, Store};

mod connection;

pub use connection::end_predecessor;

/// A live mount; unmounts on drop.
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    rings: Option<Rings>,
    store: Arc<Store>,
    dir: PathBuf,
    state_dir: PathBuf,
}

impl Mounted {
    /// Whether requests travel over io_uring (one queue per CPU) rather than `/dev/fuse`.
    pub fn uses_uring(&self) -> bool {
        self.rings.is_some()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        self.store.set_invalidate(None);
        if let Some(s) = self.session.take()
            && let Err(e) = s.umount_and_join()
        {
            tracing::warn!("unmounting {}: {e}", self.dir.display());
        }
        connection::forget(&self.state_dir);
        // The unmount ended the connection, which ends the queue threads.
        if let Some(r) = self.rings.take() {
            r.join();
        }
        tracing::info!(dir = %self.dir.display(), "unmounted");
    }
}

/// Creates the io_uring queues when `mode` asks for them and the kernel allows them.
fn prepare_rings(fs: &FuseFs<StoreFs>, mode: UringMode) -> anyhow::Result<Option<Rings>> {
    if mode == UringMode::Off {
        return Ok(None);
    }
    let r = maru_fsd::ring::allow_uring().and_then(|()| Rings::prepare(fs));
    match r {
        Ok(r) => Ok(Some(r)),
        Err(e) if mode == UringMode::On => Err(e).context("FUSE over io_uring (--fuse-uring on)"),
        Err(e) => {
            tracing::info!("FUSE over io_uring unavailable ({e}); requests go through /dev/fuse");
            Ok(None)
        }
    }
}

/// Detaches a dead FUSE mount (ENOTCONN) left at `dir` by a crashed daemon.
pub fn clear_stale(dir: &Path) -> anyhow::Result<()> {
    let Some(fstype) = crate::pool::mount_entry(dir).map(|m| m.fstype) else {
        return Ok(());
    };
    if !fstype.starts_with("fuse") {
        anyhow::bail!("{} is already a {fstype} mount", dir.display());
    }
    // A request caught by the teardown of a dead server's io_uring queues fails with
    // ECONNABORTED or ECANCELED; once the connection is gone, every request gets ENOTCONN.
    let mut probe = std::fs::metadata(dir);
    for _ in 0..50 {
        match &probe {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::ECANCELED)) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
                probe = std::fs::metadata(dir);
            }
            _ => break,
        }
    }
    match probe {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            tracing::warn!(dir = %dir.display(), "replacing a dead mount left by a crash");
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
            // SAFETY: valid C string.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                return Err(std::io::Error::last_os_error()).context("detaching the dead mount");
            }
            Ok(())
        }
        _ => anyhow::bail!("{} is already mounted by a live FUSE server", dir.display()),
    }
}

/// Mounts the filesystem at `dir` with `threads` workers for `/dev/fuse`; `uring` says
/// whether requests should rather come over io_uring, one queue per CPU. The connection is
/// recorded in `state_dir` for the next start ([`end_predecessor`]).
pub fn mount(
    store: Arc<Store>,
    dir: &Path,
    state_dir: &Path,
    threads: usize,
    uring: UringMode,
) -> anyhow::Result<Mounted> {
    clear_stale(dir)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        fuser::MountOption::FSName("maru".into()),
        fuser::MountOption::Subtype("maru".into()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoExec,
    ];
    cfg.acl = fuser::SessionACL::All;
    cfg.n_threads = Some(threads.max(1));
    cfg.clone_fd = true;
    let fs = FuseFs::new(Fs::new(StoreFs(store.clone())));
    let backings = fs.backings();
    let rings = prepare_rings(&fs, uring)?;
    let handle = fs.share();
    // The session answers INIT before it returns: io_uring is agreed on (or not) by then.
    let session = fuser::Session::new(fs, dir, &cfg)
        .with_context(|| format!("mounting the filesystem on {}", dir.display()))?;
    let dev = std::os::fd::AsFd::as_fd(&session)
        .try_clone_to_owned()
        .context("duplicating the FUSE descriptor")?;
    let session = session
        .spawn()
        .with_context(|| format!("serving the filesystem on {}", dir.display()))?;
    let rings = match rings {
        Some(r) => match r.start(&handle, dev) {
            Ok(Some(r)) => Some(r),
            Ok(None) if uring == UringMode::On => {
                drop(session);
                anyhow::bail!("the kernel refused FUSE over io_uring (--fuse-uring on)");
            }
            Ok(None) => None,
            Err(e) => {
                drop(session);
                return Err(e).context("starting the io_uring queues");
            }
        },
        None => None,
    };
    // Names removed behind the kernel's back (socket deletes, eviction) are invalidated from
    // a thread of their own: never from inside a FUSE request.
    let notifier = session.notifier();
    let (tx, rx) = std::sync::mpsc::channel::<Invalidation>();
    std::thread::Builder::new()
        .name("maru-inval".into())
        .spawn(move || {
            for inv in rx {
                // Best effort: a name the kernel no longer caches (ENOENT) needs nothing, and a
                // connection being torn down (the unmount) ends this thread anyway.
                let _ = notifier.delete(
                    fuser::INodeNo(inv.parent),
                    fuser::INodeNo(inv.ino),
                    std::ffi::OsStr::new(&inv.name),
                );
                let _ = notifier
                    .inval_entry(fuser::INodeNo(inv.parent), std::ffi::OsStr::new(&inv.name));
            }
        })?;
    let tx = parking_lot::Mutex::new(tx);
    // The passthrough backing is dropped at once (an ioctl, safe inside a request), so that
    // the pool gets the memory back before the store looks at its free space again; the
    // kernel's name cache is told from the thread above.
    store.set_invalidate(Some(Box::new(move |inv| {
        backings.forget(inv.ino);
        if !inv.by_kernel {
            // Fails only once the thread above has ended (the mount is going away).
            let _ = tx.lock().send(inv);
        }
    })));
    connection::record(state_dir, dir);
    tracing::info!(
        dir = %dir.display(),
        transport = if rings.is_some() { "io_uring" } else { "/dev/fuse" },
        "mounted"
    );
    Ok(Mounted {
        session: Some(session),
        rings,
        store,
        dir: dir.to_owned(),
        state_dir: state_dir.to_owned(),
    })
}
