//! marud's settings: command-line flags over a TOML config file over defaults.

use std::path::PathBuf;

use clap::Parser;

use crate::pool::PoolSpec;
use crate::store::Eviction;

pub use maru::daemon_config::{DEFAULT_MOUNT, DEFAULT_POOL, DEFAULT_SOCKET, DEFAULT_STATE_DIR};
/// Default niceness: left alone (see `--nice`).
pub const DEFAULT_NICE: i32 = 0;

/// Seconds a cluster host stays gone before the others may evict its entries, unless
/// configured.
pub const DEFAULT_ORPHANS_AFTER: u64 = 300;

/// Control socket connections served at once unless configured.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// marud: the maru KV-cache store daemon.
///
/// With no flags it runs the embedded default: one memfs pool (a daemon-mounted tmpfs with 2 MiB
/// pages, half of RAM) under /run/maru/pool0, the filesystem at /maru, the control socket at
/// /run/maru/marud.sock and state under /var/lib/maru.
#[derive(Debug, Parser, Default)]
#[command(name = "marud", version)]
pub struct Cli {
    /// A pool: memfs:DIR[,size=N][,huge=within_size|always|never][,numa=N][,acl=on|off][,pack=N][,name=X]
    /// (pack: the largest entry packed with its namespace's other small ones, 64K; 0: none),
    /// devdax:/dev/daxX.Y[,name=X][,coherent=false] or file:PATH,size=N[,name=X][,coherent=false].
    /// Repeatable; placement tries pools in this order.
    #[arg(long = "pool", value_name = "SPEC")]
    pub pools: Vec<String>,
    /// Where to mount the filesystem.
    #[arg(long, value_name = "DIR")]
    pub mount: Option<PathBuf>,
    /// Do not mount the filesystem (control socket only).
    #[arg(long)]
    pub no_mount: bool,
    /// The control socket.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Group that may use the socket and the mount (default: `maru` if it exists).
    #[arg(long, value_name = "GROUP")]
    pub group: Option<String>,
    /// Where namespaces and raw pool logs are kept.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// A TOML config file (flags win over it).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax; `MARU_LOG` wins).
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// What to do when pools are full: `lru` (evict) or `off` (ENOSPC).
    #[arg(long, value_name = "POLICY")]
    pub eviction: Option<String>,
    /// Unmount the memfs pools this daemon mounted when it exits cleanly (drops their entries).
    #[arg(long)]
    pub unmount_pools: bool,
    /// fsync raw pool logs after each record.
    #[arg(long)]
    pub wal_sync: bool,
    /// FUSE worker threads (for requests that come through /dev/fuse).
    #[arg(long, value_name = "N")]
    pub fuse_threads: Option<usize>,
    /// FUSE over io_uring, one request queue per CPU served on that CPU: `auto` (default: when
    /// the kernel has it, turning `fuse.enable_uring` on), `on` (required) or `off`.
    #[arg(long, value_name = "MODE")]
    pub fuse_uring: Option<String>,
    /// Scheduling niceness of the daemon (-20..19; default 0, left alone). Every retrieval
    /// through the mount waits for one of its threads; a negative value puts it ahead of busy
    /// inference threads.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub nice: Option<i32>,
    /// Connections to the control socket served at once (default 4096; each has a thread).
    /// One more is answered `busy` and closed.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Write the daemon's pid here once it serves.
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9860), path /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Cluster mode: the etcd endpoints (http://HOST:2379[,http://...]) of the hosts sharing
    /// the one raw pool given with --pool (its device initialized once, by `maructl device
    /// init`). Needs --node.
    #[arg(long, value_name = "URLS")]
    pub cluster: Option<String>,
    /// This host's name in the cluster.
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
    /// Seconds a dead or cut-off host keeps its claims (its etcd lease's TTL; default 10).
    #[arg(long, value_name = "SECS")]
    pub cluster_ttl: Option<u64>,
    /// Seconds a host stays gone (its lease ran out, it has not come back) before the other
    /// hosts may evict its entries, which otherwise only it evicts (default 300).
    #[arg(long, value_name = "SECS")]
    pub cluster_orphans_after: Option<u64>,
    /// The remote door: workers on hosts without CXL store and load entries in this host's
    /// raw pool with one-sided NIXL reads and writes, their control requests on this TCP
    /// address (e.g. 0.0.0.0:7860). Needs NIXL at run time, a raw pool, and a token file or
    /// --remote-anonymous. See doc/REMOTE.md.
    #[arg(long, value_name = "ADDR:PORT")]
    pub remote_bind: Option<std::net::SocketAddr>,
    /// The raw pool remote entries live in (default: the first raw pool).
    #[arg(long, value_name = "NAME")]
    pub remote_pool: Option<String>,
    /// Remote workers' tokens: `TOKEN UID:GID [NAME]` a line, the file root's and mode 0600.
    #[arg(long, value_name = "FILE")]
    pub remote_tokens: Option<PathBuf>,
    /// Admit remote workers without a token, acting as UID:GID.
    #[arg(long, value_name = "UID:GID")]
    pub remote_anonymous: Option<String>,
    /// Seconds a remote reservation lives unpublished (default 60).
    #[arg(long, value_name = "SECS")]
    pub remote_reserve_ttl: Option<u64>,
    /// Seconds a remote read protection lives unreleased (default 120).
    #[arg(long, value_name = "SECS")]
    pub remote_read_ttl: Option<u64>,
    /// Seconds pages of a timed-out remote write are kept from use (default 300).
    #[arg(long, value_name = "SECS")]
    pub remote_quarantine_ttl: Option<u64>,
    /// RDMA devices for NIXL's UCX backend (e.g. mlx5_0, comma-separated; NIXL adds the
    /// port); default: UCX's choice. For TCP interfaces set UCX_NET_DEVICES instead.
    #[arg(long, value_name = "DEVICES")]
    pub remote_ucx_devices: Option<String>,
}

/// The config file: every flag has a key (one definition, shared with `maructl doctor`).
pub use maru::daemon_config::FileConfig;

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Pools.
    pub pools: Vec<PoolSpec>,
    /// Mount point (None = no mount).
    pub mount: Option<PathBuf>,
    /// Socket.
    pub socket: PathBuf,
    /// Group name.
    pub group: Option<String>,
    /// State dir.
    pub state_dir: PathBuf,
    /// Log filter.
    pub log_level: String,
    /// Eviction.
    pub eviction: Eviction,
    /// Unmount pools at exit.
    pub unmount_pools: bool,
    /// fsync logs.
    pub wal_sync: bool,
    /// FUSE threads.
    pub fuse_threads: usize,
    /// FUSE over io_uring.
    pub fuse_uring: maru_fsd::ring::UringMode,
    /// Niceness (-20..19).
    pub nice: i32,
    /// Control socket connections served at once.
    pub max_connections: usize,
    /// Pid file.
    pub pid_file: Option<PathBuf>,
    /// Metrics address.
    pub metrics: Option<std::net::SocketAddr>,
    /// Cluster mode.
    pub cluster: Option<crate::cluster::ClusterSettings>,
    /// The remote door.
    pub remote: Option<crate::remote::RemoteSettings>,
}

impl Settings {
    /// Merges flags over the config file over defaults.
    pub fn resolve(cli: Cli) -> anyhow::Result<Self> {
        use anyhow::Context;
        let file: FileConfig = match &cli.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading config {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing config {}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let specs = if !cli.pools.is_empty() {
            cli.pools
        } else if !file.pools.is_empty() {
            file.pools
        } else {
            vec![DEFAULT_POOL.to_owned()]
        };
        let pools = specs
            .iter()
            .map(|s| PoolSpec::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let no_mount = cli.no_mount || file.no_mount.unwrap_or(false);
        let eviction = match cli
            .eviction
            .or(file.eviction)
            .unwrap_or_else(|| "lru".into())
            .as_str()
        {
            "lru" => Eviction::Lru,
            "off" => Eviction::Off,
            other => anyhow::bail!("eviction must be `lru` or `off`, not `{other}`"),
        };
        let cluster = match (cli.cluster.or(file.cluster), cli.node.or(file.node)) {
            (None, None) => None,
            (Some(_), None) => anyhow::bail!("--cluster needs --node NAME"),
            (None, Some(_)) => anyhow::bail!("--node is for cluster mode: give --cluster too"),
            (Some(urls), Some(node)) => {
                let endpoints: Vec<String> = urls
                    .split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .map(str::to_owned)
                    .collect();
                if endpoints.is_empty() {
                    anyhow::bail!("--cluster names no etcd endpoint");
                }
                if pools.len() != 1 || !pools[0].kind.is_raw() {
                    anyhow::bail!(
                        "cluster mode shares exactly one raw pool (devdax: or file:), given once \
                         with --pool"
                    );
                }
                maru::name::check_component(node.as_bytes())
                    .map_err(|e| anyhow::anyhow!("--node: {e}"))?;
                let ttl = cli.cluster_ttl.or(file.cluster_ttl).unwrap_or(10).max(1);
                Some(crate::cluster::ClusterSettings {
                    endpoints,
                    node,
                    ttl: std::time::Duration::from_secs(ttl),
                    orphans_after: std::time::Duration::from_secs(
                        cli.cluster_orphans_after
                            .or(file.cluster_orphans_after)
                            .unwrap_or(DEFAULT_ORPHANS_AFTER),
                    ),
                })
            }
        };
        let remote = match cli.remote_bind.or(file.remote_bind) {
            None => None,
            Some(_) if cluster.is_some() => anyhow::bail!(
                "the remote door serves a pool of this host's alone: it is not offered in \
                 cluster mode (a remote WRITE would not be fenced when this host loses its \
                 etcd lease); give --remote-bind or --cluster, not both"
            ),
            Some(bind) => {
                let mut r = crate::remote::RemoteSettings::new(bind);
                r.pool = cli.remote_pool.or(file.remote_pool);
                r.tokens = cli.remote_tokens.or(file.remote_tokens);
                r.anonymous = cli
                    .remote_anonymous
                    .or(file.remote_anonymous)
                    .map(|a| crate::remote::auth::parse_ids(&a))
                    .transpose()
                    .context("--remote-anonymous")?;
                let secs = |flag: Option<u64>, key: Option<u64>, default: std::time::Duration| {
                    flag.or(key)
                        .map_or(default, |s| std::time::Duration::from_secs(s.max(1)))
                };
                r.reserve_ttl = secs(
                    cli.remote_reserve_ttl,
                    file.remote_reserve_ttl,
                    r.reserve_ttl,
                );
                r.read_ttl = secs(cli.remote_read_ttl, file.remote_read_ttl, r.read_ttl);
                r.quarantine_ttl = secs(
                    cli.remote_quarantine_ttl,
                    file.remote_quarantine_ttl,
                    r.quarantine_ttl,
                );
                r.ucx_devices = cli.remote_ucx_devices.or(file.remote_ucx_devices);
                Some(r)
            }
        };
        Ok(Settings {
            pools,
            mount: if no_mount {
                None
            } else {
                Some(
                    cli.mount
                        .or(file.mount)
                        .unwrap_or_else(|| DEFAULT_MOUNT.into()),
                )
            },
            socket: cli
                .socket
                .or(file.socket)
                .unwrap_or_else(|| DEFAULT_SOCKET.into()),
            group: cli.group.or(file.group),
            state_dir: cli
                .state_dir
                .or(file.state_dir)
                .unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            log_level: cli
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".into()),
            eviction,
            unmount_pools: cli.unmount_pools || file.unmount_pools.unwrap_or(false),
            wal_sync: cli.wal_sync || file.wal_sync.unwrap_or(false),
            fuse_threads: cli.fuse_threads.or(file.fuse_threads).unwrap_or(8),
            fuse_uring: cli
                .fuse_uring
                .or(file.fuse_uring)
                .as_deref()
                .unwrap_or("auto")
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--fuse-uring: {e}"))?,
            nice: cli
                .nice
                .or(file.nice)
                .unwrap_or(DEFAULT_NICE)
                .clamp(-20, 19),
            max_connections: match cli.max_connections.or(file.max_connections) {
                Some(0) => anyhow::bail!("max_connections must be at least 1"),
                n => n.unwrap_or(DEFAULT_MAX_CONNECTIONS),
            },
            pid_file: cli.pid_file.or(file.pid_file),
            metrics: cli.metrics.or(file.metrics),
            cluster,
            remote,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remote_door_is_refused_in_cluster_mode() {
        let cli = Cli {
            pools: vec!["file:/tmp/maru-pool.img,size=64M".into()],
            cluster: Some("http://127.0.0.1:2379".into()),
            node: Some("h0".into()),
            remote_bind: Some("127.0.0.1:7860".parse().unwrap()),
            ..Default::default()
        };
        let e = Settings::resolve(cli).unwrap_err().to_string();
        assert!(e.contains("not offered in cluster mode"), "{e}");
    }

    #[test]
    fn flags_win_over_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("marud.toml");
        std::fs::write(
            &cfg,
            "pools = [\"memfs:/tmp/a,size=1G\"]\nsocket = \"/tmp/f.sock\"\neviction = \"off\"\n",
        )
        .unwrap();
        let cli = Cli {
            config: Some(cfg.clone()),
            socket: Some("/tmp/flag.sock".into()),
            ..Default::default()
        };
        let s = Settings::resolve(cli).unwrap();
        assert_eq!(s.socket, PathBuf::from("/tmp/flag.sock"));
        assert_eq!(s.eviction, Eviction::Off);
        assert_eq!(s.pools[0].size, Some(1 << 30));
        assert_eq!(s.mount, Some(PathBuf::from("/maru")));
        let d = Settings::resolve(Cli::default()).unwrap();
        assert_eq!(d.pools[0].path, PathBuf::from("/run/maru/pool0"));
        assert_eq!(d.fuse_uring, maru_fsd::ring::UringMode::Auto);
        std::fs::write(&cfg, "fuse_uring = \"off\"\n").unwrap();
        let file_only = Cli {
            config: Some(cfg.clone()),
            ..Default::default()
        };
        assert_eq!(
            Settings::resolve(file_only).unwrap().fuse_uring,
            maru_fsd::ring::UringMode::Off
        );
        let flag = Cli {
            config: Some(cfg.clone()),
            fuse_uring: Some("on".into()),
            ..Default::default()
        };
        assert_eq!(
            Settings::resolve(flag).unwrap().fuse_uring,
            maru_fsd::ring::UringMode::On
        );
        let bad = Cli {
            fuse_uring: Some("sometimes".into()),
            ..Default::default()
        };
        assert!(Settings::resolve(bad).is_err());
        std::fs::write(&cfg, "bogus = 1\n").unwrap();
        assert!(
            Settings::resolve(Cli {
                config: Some(cfg),
                ..Default::default()
            })
            .is_err()
        );
    }
}
