//! The remote door: workers on hosts without CXL store and load entries in this host's pool.
//!
//! marud maps the raw pool that remote entries live in (a CXL DAX device, or a `file:` pool)
//! whole, registers that mapping with NIXL once (so the registration granularity is the pool:
//! one registration, one metadata blob, every region in it from the start), and answers the
//! control requests of `maru_remote::proto` on a TCP port. The bytes move by one-sided NIXL
//! WRITE and READ between the workers' memory and the pool's; no thread of marud touches them.
//!
//! What a worker stores is an entry like any other: each connection is a store session acting
//! as the identity its token maps to ([`auth`]), so the same policy, quotas, eviction, pins,
//! write-once publication and persistence apply, and the entry is listed under `/maru` and
//! retrieved by local clients. A reservation is an allocation of the session; a read
//! protection is a lease on the entry (a lease keeps a deleted entry's extent from reuse).
//! Both end after their TTLs ([`conn`]), when the worker says so, or when its connection
//! ends; pages quarantined after a timed-out WRITE outlive the connection until their own TTL.
//!
//! Each marud run has a generation (random); a request for another is refused, and the
//! worker reconnects. See doc/REMOTE.md.

pub mod auth;
mod conn;
mod listing;
mod state;

use state::Shared;
pub use state::{RemoteSettings, RemoteStats, WorkerInfo};

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use maru_nixl::{AgentConfig, Desc, Mem, Nixl};
use maru_remote::proto::{Blob, Registration};

use crate::store::Store;

/// The running door. Dropping it does not stop it: it serves until marud exits.
pub struct RemoteDoor {
    pub addr: SocketAddr,
    pub generation: u64,
    pub stats: Arc<RemoteStats>,
}

/// The pool's mapping, registered with NIXL for marud's life.
struct PoolMapping {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: a shared mapping of the pool device, never unmapped while marud runs; marud itself
// never reads or writes through it (only NIXL's transport does, on the workers' behalf).
unsafe impl Send for PoolMapping {}
// SAFETY: as above.
unsafe impl Sync for PoolMapping {}

impl RemoteDoor {
    /// Loads NIXL before marud starts its threads (NIXL's plugin directory is an environment
    /// variable): a clear error when NIXL is not installed.
    pub fn load_nixl() -> anyhow::Result<Nixl> {
        Nixl::load().context("the remote door (remote_bind) needs NIXL")
    }

    /// Starts the door: maps and registers the pool, listens, serves each worker on a
    /// thread of its own.
    pub fn start(
        store: Arc<Store>,
        settings: RemoteSettings,
        nixl: &Nixl,
    ) -> anyhow::Result<RemoteDoor> {
        let tokens = auth::Tokens::load(settings.tokens.as_deref(), settings.anonymous)?;
        let pools = store.pools();
        let info = match &settings.pool {
            Some(name) => pools
                .iter()
                .find(|p| &p.name == name)
                .with_context(|| format!("remote_pool: no pool named `{name}`"))?,
            None => pools.iter().find(|p| p.kind.is_raw()).context(
                "the remote door serves a raw pool (devdax: or file:); this marud has none",
            )?,
        };
        if !info.kind.is_raw() {
            bail!(
                "remote_pool `{}` is not a raw pool (devdax: or file:)",
                info.name
            );
        }
        let file = store
            .raw_pool_fd(info.id, true)
            .map_err(|e| anyhow::anyhow!("opening pool `{}`: {e}", info.name))?;
        let pool_uuid = maru::format::read_header(&file)?
            .map(|h| h.uuid_string())
            .unwrap_or_else(|| info.name.clone());
        let len = info.mapped_len as usize;
        // SAFETY: a shared read-write mapping of the whole pool device, kept for marud's life
        // (the registration below points into it).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                // Populated now: a remote WRITE into a page nobody touched yet would otherwise
                // fault it in on the transport's receive path (a memory pool is meant to be
                // resident anyway).
                libc::MAP_SHARED | libc::MAP_POPULATE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            bail!(
                "mapping pool `{}` for the remote door: {}",
                info.name,
                std::io::Error::last_os_error()
            );
        }
        let mapping = Box::leak(Box::new(PoolMapping { addr, len }));
        let generation = loop {
            let g = uuid::Uuid::new_v4().as_u64_pair().0;
            if g != 0 {
                break g;
            }
        };
        let agent_name = format!("marud-{generation:016x}");
        let mut agent = nixl
            .agent(&agent_name, &AgentConfig::default())
            .context("creating marud's NIXL agent")?;
        // NIXL's UCX plugin takes RDMA devices as "dev, dev" and adds the port itself.
        let devices = settings.ucx_devices.as_deref().map(|d| {
            d.split(',')
                .map(|x| x.trim().trim_end_matches(":1"))
                .filter(|x| !x.is_empty())
                .collect::<Vec<_>>()
                .join(", ")
        });
        let params: Vec<(&str, &str)> = devices
            .as_deref()
            .map(|d| vec![("device_list", d)])
            .unwrap_or_default();
        agent
            .add_backend("UCX", &params)
            .context("NIXL's UCX backend")?;
        let region = Desc::host(mapping.addr as u64, mapping.len as u64);
        agent
            .register(Mem::Dram, &[region])
            .with_context(|| format!("registering pool `{}` with NIXL", info.name))?;
        let registration = Registration {
            agent: agent_name,
            metadata: Blob(agent.metadata().context("NIXL metadata")?),
            version: 1,
            regions: vec![(region.addr, region.len)],
        };
        // The agent serves for marud's life: its registration is what workers reach.
        Box::leak(Box::new(agent));

        let listener = TcpListener::bind(settings.bind)
            .with_context(|| format!("remote door: binding {}", settings.bind))?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(RemoteStats::new(
            addr,
            generation,
            info.name.clone(),
            pool_uuid.clone(),
        ));
        store.set_remote(stats.clone());
        let shared = Arc::new(Shared {
            store,
            tokens,
            generation,
            pool: info.id,
            pool_name: info.name.clone(),
            pool_uuid,
            base: region.addr,
            len: region.len,
            registration,
            stats: stats.clone(),
            next_conn: AtomicU64::new(1),
            settings,
        });
        tracing::info!(
            %addr,
            pool = %shared.pool_name,
            generation = format_args!("{generation:016x}"),
            bytes = shared.len,
            "remote door open (NIXL, one-sided)"
        );
        std::thread::Builder::new()
            .name("remote-door".into())
            .spawn(move || accept_loop(listener, shared))?;
        Ok(RemoteDoor {
            addr,
            generation,
            stats,
        })
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("remote door: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let shared = shared.clone();
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name(format!("remote-{id}"))
            .spawn(move || conn::serve(shared, stream, id));
        if let Err(e) = spawned {
            tracing::warn!("remote door: no thread for a worker: {e}");
        }
    }
}
