//! marud: the maru daemon.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use maru_daemon::config::{Cli, Settings};
use maru_daemon::store::{Store, StoreConfig};
use maru_daemon::{mount, server};

/// Logs go to journald when marud runs under systemd (`JOURNAL_STREAM` is set), to stderr
/// otherwise. `MARU_LOG` (an EnvFilter) wins over `--log-level`.
fn init_logging(filter: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("MARU_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
    let journald = std::env::var_os("JOURNAL_STREAM")
        .is_some()
        .then(tracing_journald::layer)
        .and_then(Result::ok);
    match journald {
        Some(j) => tracing_subscriber::registry().with(filter).with(j).init(),
        None => tracing_subscriber::registry()
            .with(filter)
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .init(),
    }
}

fn group_id(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: valid C string; getgrnam returns a pointer into static storage or NULL.
    let g = unsafe { libc::getgrnam(c.as_ptr()) };
    if g.is_null() {
        None
    } else {
        // SAFETY: non-null result of getgrnam.
        Some(unsafe { (*g).gr_gid })
    }
}

fn main() {
    let cli = Cli::parse();
    let settings = match Settings::resolve(cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("marud: {e:#}");
            std::process::exit(2);
        }
    };
    init_logging(&settings.log_level);
    if let Err(e) = run(settings) {
        tracing::error!("{e:#}");
        eprintln!("marud: {e:#}");
        std::process::exit(1);
    }
}

/// Capabilities marud keeps (doc/SECURITY.md says why each).
const KEEP_CAPS: [caps::Capability; 4] = [
    caps::Capability::CAP_SYS_ADMIN,
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_FOWNER,
    caps::Capability::CAP_DAC_OVERRIDE,
];

/// Drops every capability but [`KEEP_CAPS`] from the bounding, permitted, effective and
/// inheritable sets. Runs before any thread is started: capabilities are per thread.
fn drop_capabilities() -> anyhow::Result<()> {
    use caps::{CapSet, CapsHashSet};
    let keep: CapsHashSet = KEEP_CAPS.into_iter().collect();
    let permitted = caps::read(None, CapSet::Permitted)?;
    if permitted.is_empty() {
        return Ok(()); // not privileged: nothing to drop (mounting will fail with a clear error)
    }
    for c in caps::all() {
        if !keep.contains(&c) && caps::has_cap(None, CapSet::Bounding, c).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, c)?;
        }
    }
    let kept: CapsHashSet = permitted.intersection(&keep).copied().collect();
    caps::set(None, CapSet::Inheritable, &CapsHashSet::new())?;
    caps::set(None, CapSet::Effective, &kept)?;
    caps::set(None, CapSet::Permitted, &kept)?;
    Ok(())
}

/// Lets marud hold as many descriptors as the hard limit allows (connections, entries open).
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid out-parameter.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Sets the daemon's niceness (`--nice`) before any thread exists (threads inherit it): every
/// retrieval through the mount waits for a FUSE thread of marud to run.
fn set_nice(nice: i32) {
    if nice == 0 {
        return;
    }
    // SAFETY: setpriority on this process; it fails without CAP_SYS_NICE, which is reported.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
        tracing::warn!(
            nice,
            "cannot set the daemon's niceness: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn run(s: Settings) -> anyhow::Result<()> {
    // Files the daemon creates are its own unless it says otherwise.
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0o077) };
    raise_fd_limit();
    set_nice(s.nice);
    drop_capabilities().context("dropping capabilities")?;
    let gid = match &s.group {
        Some(g) => Some(group_id(g).with_context(|| format!("no group named `{g}`"))?),
        None => group_id("maru"),
    };
    let store = Store::open(
        StoreConfig {
            eviction: s.eviction,
            state_dir: s.state_dir.clone(),
            wal_sync: s.wal_sync,
            max_copy_entry: 1 << 30,
        },
        &s.pools,
    )?;
    for p in store.pools() {
        tracing::info!(pool = %p.name, kind = ?p.kind, capacity = p.capacity, entries = p.entries, "pool ready");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mounted = match &s.mount {
        Some(dir) => Some(mount::mount(
            store.clone(),
            dir,
            s.fuse_threads,
            s.fuse_uring,
        )?),
        None => None,
    };
    let result = rt.block_on(async {
        let listener = server::bind(&s.socket, gid)?;
        tracing::info!(socket = %s.socket.display(), "serving");
        if let Some(p) = &s.pid_file {
            std::fs::write(p, format!("{}\n", std::process::id()))?;
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let srv = tokio::spawn(server::serve(store.clone(), listener));
        let metrics = match s.metrics {
            Some(addr) => {
                // Bind now so that a bad address fails the start, not a background task.
                let st = store.clone();
                let l = std::net::TcpListener::bind(addr)
                    .with_context(|| format!("binding the metrics address {addr}"))?;
                drop(l);
                Some(tokio::spawn(async move {
                    if let Err(e) = maru_daemon::metrics::serve(st, addr).await {
                        tracing::error!("metrics server: {e}");
                    }
                }))
            }
            None => None,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
            _ = term.recv() => tracing::info!("terminated"),
        }
        srv.abort();
        if let Some(m) = metrics {
            m.abort();
        }
        anyhow::Ok(())
    });
    drop(mounted);
    let _ = std::fs::remove_file(&s.socket);
    store.sync();
    if s.unmount_pools {
        store.unmount_pools();
    }
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    tracing::info!("stopped");
    let _: Arc<Store> = store;
    result
}
