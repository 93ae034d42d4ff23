//! maructl: administer, script and benchmark maru.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// maructl: talk to marud, and benchmark maru.
#[derive(Parser)]
#[command(name = "maructl", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
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
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Retrieval through /maru against direct mapping, a copying FUSE server and TCP.
    Fs {
        /// Interleaved rounds.
        #[arg(long, default_value_t = 60)]
        rounds: usize,
        /// Also write the rows as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench { which } => match which {
            BenchCmd::Core { rounds, json } => {
                maru_tools::bench::core(rounds, json.as_deref()).map(|s| print!("{s}"))
            }
            BenchCmd::Fs { rounds, json } => {
                maru_tools::bench::fs(rounds, json.as_deref()).map(|s| print!("{s}"))
            }
        },
        Cmd::Echo => maru_tools::bench::echo_main(),
        Cmd::TcpServe { size } => maru_tools::bench::tcp_serve_main(size),
    };
    if let Err(e) = r {
        eprintln!("maructl: {e:#}");
        std::process::exit(1);
    }
}
