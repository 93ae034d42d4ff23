//! marud: the maru daemon.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use maru_daemon::config::{Cli, Settings};
use maru_daemon::store::{Store, StoreConfig};
use maru_daemon::{mount, server};

/// Logs go to journald when marud runs under systemd (`JOURNAL_STREAM` is set), to stderr
/// otherwise, coloured only when stderr is a terminal (a log redirected to a file has no
/// escape codes). `MARU_LOG` (an EnvFilter) wins over `--log-level`.
fn init_logging(filter: &str) {
    use std::io::IsTerminal;
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
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(std::io::stderr().is_terminal()),
            )
            .init(),
    }
}

/// The group given the control socket: `--group` (which must exist), else `maru` where it
/// exists.
fn socket_group(name: Option<&str>) -> anyhow::Result<Option<server::SocketGroup>> {
    use nix::unistd::Group;
    Ok(match name {
        Some(n) => {
            let g = Group::from_name(n)
                .with_context(|| format!("looking up group `{n}`"))?
                .with_context(|| format!("no group named `{n}`"))?;
            Some(server::SocketGroup {
                gid: g.gid.as_raw(),
                explicit: true,
            })
        }
        None => match Group::from_name("maru") {
            Ok(g) => g.map(|g| server::SocketGroup {
                gid: g.gid.as_raw(),
                explicit: false,
            }),
            Err(e) => {
                tracing::warn!("cannot look up the default group `maru`: {e}");
                None
            }
        },
    })
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
/// A failure leaves the soft limit, which is enough for small setups: a warning.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let r = getrlimit(Resource::RLIMIT_NOFILE).and_then(|(soft, hard)| {
        if soft < hard {
            setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
        }
        Ok(())
    });
    if let Err(e) = r {
        tracing::warn!("cannot raise the descriptor limit to the hard limit: {e}");
    }
    presize_fd_table();
}

/// Descriptor slots the process's table is given at start (see [`presize_fd_table`]).
const FD_TABLE: u64 = 65_536;

/// Gives the descriptor table [`FD_TABLE`] slots at once (fewer if the limit is lower). The
/// kernel doubles the table as descriptors are opened, and in a process with threads each
/// doubling waits for an RCU grace period: 10–19 ms measured, under the store's lock, when
/// marud opened its 256th and 512th descriptor (a pack holds two). The table never shrinks;
/// 64 Ki slots take 0.5 MiB of kernel memory and cover 32,768 packs (64 GiB of small
/// entries) besides connections.
fn presize_fd_table() {
    use nix::sys::resource::{Resource, getrlimit};
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let top = soft.min(FD_TABLE).saturating_sub(1);
    let Ok(null) = std::fs::File::open("/dev/null") else {
        return;
    };
    let Ok(top) = i32::try_from(top) else { return };
    if top <= 2 {
        return;
    }
    // libc: nix's dup2 wants an owned descriptor to replace.
    // SAFETY: `top` is checked to be free (an inherited descriptor there is left alone);
    // the duplicate made there is closed at once.
    unsafe {
        if libc::fcntl(top, libc::F_GETFD) == -1
            && libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), top) == top
        {
            libc::close(top);
        }
    }
}

/// Sets the daemon's niceness (`--nice`) before any thread exists (threads inherit it): every
/// retrieval through the mount waits for a FUSE thread of marud to run.
fn set_nice(nice: i32) {
    if nice == 0 {
        return;
    }
    // libc: nix has no setpriority.
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
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    raise_fd_limit();
    set_nice(s.nice);
    drop_capabilities().context("dropping capabilities")?;
    // A predecessor stuck in its exit holds its mount's requests and the pools' locks.
    if s.mount.is_some() {
        mount::end_predecessor(&s.state_dir, std::time::Duration::from_secs(10))?;
    }
    // NIXL is found before any thread starts (it is told its plugins by the environment).
    let nixl = match &s.remote {
        Some(_) => Some(maru_daemon::remote::RemoteDoor::load_nixl()?),
        None => None,
    };
    let group = socket_group(s.group.as_deref())?;
    let store_cfg = StoreConfig {
        eviction: s.eviction,
        state_dir: s.state_dir.clone(),
        wal_sync: s.wal_sync,
        max_copy_entry: 1 << 30,
    };
    let store = match &s.cluster {
        None => Store::open(store_cfg, &s.pools)?,
        Some(c) => {
            // The shared pool's identity is its device header's UUID.
            let spec = &s.pools[0];
            let dev = std::fs::File::open(&spec.path)
                .with_context(|| format!("opening {}", spec.path.display()))?;
            let header = maru::format::read_header(&dev)?.ok_or_else(|| {
                anyhow::anyhow!(
                    "{} has no maru header: initialize it once with `maructl device init`",
                    spec.path.display()
                )
            })?;
            let auth = maru_daemon::cluster::EtcdAuthority::join(c, &header.uuid_string())?;
            let store = Store::open_with(store_cfg, &s.pools, auth.clone())?;
            maru_daemon::cluster::applier::start_applier(store.clone(), auth)?;
            store
        }
    };
    for p in store.pools() {
        tracing::info!(pool = %p.name, kind = ?p.kind, capacity = p.capacity, entries = p.entries, "pool ready");
    }
    let _door = match (&s.remote, &nixl) {
        (Some(r), Some(nixl)) => Some(maru_daemon::remote::RemoteDoor::start(
            store.clone(),
            r.clone(),
            nixl,
        )?),
        _ => None,
    };
    // The runtime only accepts connections (each is served on a thread of its own), serves
    // metrics and waits for signals: the main thread, inside `block_on`, runs it all.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mounted = match &s.mount {
        Some(dir) => Some(mount::mount(
            store.clone(),
            dir,
            &s.state_dir,
            s.fuse_threads,
            s.fuse_uring,
        )?),
        None => None,
    };
    let result = rt.block_on(async {
        let listener = server::bind(&s.socket, group)?;
        tracing::info!(socket = %s.socket.display(), "serving");
        if let Some(p) = &s.pid_file {
            std::fs::write(p, format!("{}\n", std::process::id()))?;
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let srv = tokio::spawn(server::serve(store.clone(), listener, s.max_connections));
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
    if let Err(e) = std::fs::remove_file(&s.socket) {
        // Harmless: the next start replaces a stale socket.
        tracing::warn!(socket = %s.socket.display(), "cannot remove the socket: {e}");
    }
    store.sync();
    if s.unmount_pools {
        store.unmount_pools();
    }
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    tracing::info!("stopped");
    let _: Arc<Store> = store;
    result
}
