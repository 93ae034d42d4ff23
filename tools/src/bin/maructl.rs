//! maructl: administer, script and benchmark maru.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use maru_tools::ctl::{self, EXIT_CODES, Failure, exit};

/// maructl: talk to marud (the maru KV-cache store daemon), and benchmark maru.
#[derive(Parser)]
#[command(name = "maructl", version, after_help = EXIT_CODES)]
struct Cli {
    /// marud's control socket [default: /run/maru/marud.sock; for doctor, the config's].
    #[arg(long, global = true, env = "MARU_SOCKET")]
    socket: Option<PathBuf>,
    /// Print one JSON document (for scripts).
    #[arg(long, global = true)]
    json: bool,
    /// A memory node's remote door, tcp://HOST:PORT: ls, stat, get and put there, as a
    /// remote worker (NIXL), instead of through the local socket.
    #[arg(long, global = true, value_name = "URL")]
    remote: Option<String>,
    /// The remote door's token: the file's first line [default: $MARU_REMOTE_TOKEN, else
    /// none (anonymous)].
    #[arg(long, global = true, value_name = "FILE", requires = "remote")]
    remote_token_file: Option<PathBuf>,
    /// With --remote: the largest entry get moves (its staging buffer, registered with NIXL).
    #[arg(
        long,
        global = true,
        value_name = "SIZE",
        default_value = "64M",
        requires = "remote"
    )]
    remote_staging: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Daemon, pools, entries, clients at a glance.
    Status,
    /// Pools: capacity, use, entries, evictions.
    Pools,
    /// List a namespace (the root when omitted).
    Ls {
        /// Namespace.
        ns: Option<String>,
    },
    /// Describe an entry.
    Stat {
        /// NS/KEY.
        path: String,
    },
    /// Store a file (or stdin) as an entry.
    Put {
        /// NS/KEY.
        path: String,
        /// Input file; `-` or nothing for stdin.
        file: Option<PathBuf>,
    },
    /// Write an entry's bytes to a file (or stdout).
    Get {
        /// NS/KEY.
        path: String,
        /// Output file; `-` or nothing for stdout.
        file: Option<PathBuf>,
        /// Output file (the same as FILE).
        #[arg(
            short = 'o',
            long = "output",
            value_name = "FILE",
            conflicts_with = "file"
        )]
        output: Option<PathBuf>,
    },
    /// Delete entries.
    Rm {
        /// NS/KEY...
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Pin entries (never evicted).
    Pin {
        /// NS/KEY...
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Unpin entries.
    Unpin {
        /// NS/KEY...
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Create a namespace.
    Mkdir {
        /// Namespace.
        ns: String,
        /// Mode (octal).
        #[arg(long, default_value = "755")]
        mode: String,
    },
    /// Remove an empty namespace.
    Rmdir {
        /// Namespace.
        ns: String,
    },
    /// Set a namespace's quota (bytes of sealed entries in it and under it; root only).
    Quota {
        /// Namespace.
        ns: String,
        /// Size (e.g. 64G), or `none` to clear it.
        size: String,
    },
    /// Evict least recently used entries until this much is free in every pool.
    Evict {
        /// Bytes to make free (suffixes: 512M, 4G).
        #[arg(long)]
        bytes: String,
    },
    /// Check this host for marud, line by line, with what to do where something fails.
    ///
    /// FUSE (passthrough, io_uring), huge pages, NUMA nodes, DAX devices, marud on its
    /// socket and its mount, the state directory, the group, etcd (cluster mode) and NIXL.
    /// Exit 0 when no check fails (doc/OPERATIONS.md, `maructl doctor`).
    Doctor {
        /// marud's config file [default: /etc/maru/marud.toml where it exists, else marud's
        /// built-in defaults].
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
    },
    /// The header of a devdax or file: pool (no daemon needed; refused while marud uses it).
    Device(ctl::DeviceArgs),
    /// Benchmarks measured side by side in one run (starts its own daemon).
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    #[command(name = "__echo", hide = true)]
    Echo,
    #[command(name = "__tcp-serve", hide = true)]
    TcpServe { size: usize },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The store engine and libmaru against memcpy, direct mapping and a socket round trip.
    Core {
        /// Interleaved rounds of the timed cases.
        #[arg(long, default_value_t = 200)]
        rounds: usize,
        /// Also write the rows as JSON here.
        #[arg(long = "out-json", value_name = "FILE")]
        out_json: Option<PathBuf>,
    },
    /// Retrieval through /maru against direct mapping, a copying FUSE server and TCP.
    Fs {
        /// Interleaved rounds.
        #[arg(long, default_value_t = 60)]
        rounds: usize,
        /// Also write the rows as JSON here.
        #[arg(long = "out-json", value_name = "FILE")]
        out_json: Option<PathBuf>,
        /// Extra flag for the benchmark's marud (repeatable), e.g. `--marud-arg=--fuse-uring=off`.
        #[arg(long = "marud-arg", value_name = "ARG", allow_hyphen_values = true)]
        marud_arg: Vec<String>,
    },
    /// 4 KiB stores while another client allocates a large file on the same memfs pool (or
    /// writes a large entry through the mount into a raw pool), against the same stores alone.
    Stall {
        /// The other client's allocation (its pool is this and 1 GiB more, in memory).
        #[arg(long, default_value = "8G")]
        size: String,
        /// Alternated rounds (a window alone, a window with the allocation).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Also write the rows as JSON here.
        #[arg(long = "out-json", value_name = "FILE")]
        out_json: Option<PathBuf>,
        /// The large work is a process writing an entry of `--size` through the mount into a
        /// raw pool and closing it (at most marud's largest copied entry, 1 GiB).
        #[arg(long = "through-mount")]
        through_mount: bool,
        /// The marud to measure (default: the one beside maructl).
        #[arg(long, value_name = "PATH")]
        marud: Option<PathBuf>,
    },
}

fn bad(msg: String) -> Failure {
    Failure {
        code: exit::INVALID,
        kind: "invalid_argument".into(),
        message: msg,
    }
}

/// `maructl --remote URL COMMAND`: the commands a remote worker can do.
fn run_remote(cli: Cli, url: &str) -> Result<Option<ctl::Output>, Failure> {
    use maru_tools::remote;
    let token = remote::token(cli.remote_token_file.as_deref())?;
    let staging = maru::size::parse_size(&cli.remote_staging)
        .map_err(|e| bad(format!("--remote-staging: {e}")))?;
    let r = match cli.cmd {
        Cmd::Ls { ns } => {
            let c = remote::connect(url, token, 4096)?;
            remote::ls(&c, ns.as_deref().unwrap_or(""))
        }
        Cmd::Stat { path } => remote::stat(&remote::connect(url, token, 4096)?, &path),
        Cmd::Get { path, file, output } => {
            let c = remote::connect(url, token, staging)?;
            remote::get(&c, &path, output.or(file).as_deref(), cli.json)
        }
        Cmd::Put { path, file } => {
            let data = remote::input(file.as_deref())?;
            let c = remote::connect(url, token, data.len() as u64)?;
            remote::put(&c, &path, &data)
        }
        _ => Err(Failure {
            code: exit::USAGE,
            kind: "usage".into(),
            message: "with --remote, maructl does ls, stat, get and put; the other commands \
                      talk to the local marud (leave --remote out)"
                .into(),
        }),
    };
    r.map(Some)
}

fn run(cli: Cli) -> Result<Option<ctl::Output>, Failure> {
    if let Some(url) = cli.remote.clone() {
        return run_remote(cli, &url);
    }
    let sock = cli
        .socket
        .clone()
        .unwrap_or_else(|| maru::DEFAULT_SOCKET.into());
    let h = || ctl::connect(&sock);
    let r = match cli.cmd {
        Cmd::Status => ctl::status(&h()?),
        Cmd::Pools => ctl::pools(&h()?),
        Cmd::Ls { ns } => ctl::ls(&h()?, ns.as_deref().unwrap_or("")),
        Cmd::Stat { path } => ctl::stat(&h()?, &path),
        Cmd::Put { path, file } => ctl::put(&h()?, &path, file.as_deref()),
        Cmd::Get { path, file, output } => {
            ctl::get(&h()?, &path, output.or(file).as_deref(), cli.json)
        }
        Cmd::Rm { paths } => ctl::rm(&h()?, &paths),
        Cmd::Pin { paths } => ctl::pin(&h()?, &paths, true),
        Cmd::Unpin { paths } => ctl::pin(&h()?, &paths, false),
        Cmd::Mkdir { ns, mode } => {
            let m = u32::from_str_radix(&mode, 8).map_err(|_| bad(format!("bad mode `{mode}`")))?;
            ctl::mkdir(&h()?, &ns, m)
        }
        Cmd::Rmdir { ns } => ctl::rmdir(&h()?, &ns),
        Cmd::Quota { ns, size } => {
            let b = match size.as_str() {
                "none" => None,
                s => Some(maru::size::parse_size(s).map_err(|e| bad(e.to_string()))?),
            };
            ctl::quota(&h()?, &ns, b)
        }
        Cmd::Evict { bytes } => {
            let b = maru::size::parse_size(&bytes).map_err(|e| bad(e.to_string()))?;
            ctl::evict(&h()?, b)
        }
        Cmd::Device(args) => args.run(),
        Cmd::Doctor { .. } => unreachable!("doctor prints its own report (main)"),
        Cmd::Bench { which } => {
            let text = match which {
                BenchCmd::Core { rounds, out_json } => {
                    maru_tools::bench::core(rounds, out_json.as_deref())
                }
                BenchCmd::Fs {
                    rounds,
                    out_json,
                    marud_arg,
                } => maru_tools::bench::fs(rounds, out_json.as_deref(), &marud_arg),
                BenchCmd::Stall {
                    size,
                    rounds,
                    out_json,
                    through_mount,
                    marud,
                } => {
                    let big = maru::size::parse_size(&size).map_err(|e| bad(e.to_string()))?;
                    let args = maru_tools::bench::stall::StallArgs {
                        big,
                        rounds: rounds.max(1),
                        through_mount,
                        marud,
                    };
                    maru_tools::bench::stall::stall(&args, out_json.as_deref())
                }
            }
            .map_err(|e| Failure {
                code: exit::FAILED,
                kind: "bench".into(),
                message: format!("{e:#}"),
            })?;
            print!("{text}");
            return Ok(None);
        }
        // The benchmark's peers: they end with an error when the benchmark closes their
        // socket, which is how they are meant to end.
        Cmd::Echo => {
            let _ = maru_tools::bench::echo_main();
            return Ok(None);
        }
        Cmd::TcpServe { size } => {
            let _ = maru_tools::bench::tcp_serve_main(size);
            return Ok(None);
        }
    };
    r.map(Some)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    if let Cmd::Doctor { config } = &cli.cmd {
        // Its own report and exit status: failed checks are output, not an error.
        return maru_tools::doctor::main(config.as_deref(), cli.socket.as_deref(), json);
    }
    ctl::finish("maructl", json, run(cli))
}
