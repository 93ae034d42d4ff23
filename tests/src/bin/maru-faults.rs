//! maru-faults: the cluster fault harness (`maru_tests::faults`), run by hand.
//!
//!     maru-faults [--seed N] [--runs N] [--duration SECS] [--faults kill,pause,...|none]
//!                 [--hosts N] [--clients N] [--keys N] [--ttl SECS] [--converge SECS]
//!                 [--no-space-check] [--keep-all]
//!
//! Run `--runs N` runs with seeds `seed, seed+1, ...`; prints each run's report and exits 1
//! if any run found a violation. Needs root and etcd (Debian's `etcd-server`).
//!
//! With `MARU_FAULTS_KEEP=DIR`, a run with violations is kept in DIR (each host's log, each
//! etcd member's, the history of the keys named); the hosts then log the cluster's changes of every entry
//! (`maru_daemon::cluster` at debug). `--keep-all` keeps every run there.

use std::time::Duration;

use maru_tests::faults::{Config, nemesis, run};

fn main() {
    let mut cfg = Config {
        keep: std::env::var_os("MARU_FAULTS_KEEP").map(Into::into),
        ..Config::default()
    };
    let mut runs = 1u64;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--no-space-check" {
            cfg.check_space = false;
            continue;
        }
        if flag == "--keep-all" {
            cfg.keep_all = true;
            continue;
        }
        let val = args
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let num = |v: &str| -> u64 { v.parse().unwrap_or_else(|_| usage(&format!("{flag} {v}"))) };
        match flag.as_str() {
            "--seed" => cfg.seed = num(&val),
            "--runs" => runs = num(&val),
            "--duration" => cfg.duration = Duration::from_secs(num(&val)),
            "--hosts" => cfg.hosts = num(&val) as usize,
            "--clients" => cfg.clients = num(&val) as usize,
            "--mount-clients" => cfg.mount_clients = num(&val) as usize,
            "--keys" => cfg.keys = num(&val),
            "--ttl" => cfg.ttl = Duration::from_secs(num(&val)),
            "--converge" => cfg.converge = Duration::from_secs(num(&val)),
            "--faults" if val == "none" => cfg.faults.clear(),
            "--faults" => {
                cfg.faults = val
                    .split(',')
                    .map(|k| {
                        nemesis::Kind::parse(k).unwrap_or_else(|| usage(&format!("fault {k}")))
                    })
                    .collect()
            }
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    let first = cfg.seed;
    let mut failed = Vec::new();
    for seed in first..first + runs {
        cfg.seed = seed;
        let Some(report) = run(&cfg) else {
            eprintln!("maru-faults: needs root and etcd");
            std::process::exit(2);
        };
        println!("{report}");
        if !report.violations.is_empty() {
            failed.push(seed);
        }
    }
    println!("{runs} runs, {} with violations {failed:?}", failed.len());
    std::process::exit(i32::from(!failed.is_empty()));
}

fn usage(why: &str) -> ! {
    eprintln!(
        "maru-faults: {why}\nusage: maru-faults [--seed N] [--runs N] [--duration SECS] \
         [--faults kill,pause,partition,etcd-kill,compact|none] [--hosts N] [--clients N] \
         [--mount-clients N] [--keys N] [--ttl SECS] [--converge SECS] [--no-space-check]"
    );
    std::process::exit(2)
}
