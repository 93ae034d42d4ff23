#!/usr/bin/env bash
# A bounded fuzzing run of the control protocol decoder and dispatcher.
#   fuzz/run.sh [SECONDS]   (default 60; the record in doc/RELIABILITY.md used 600)
# cargo-fuzz needs nightly compiler flags; RUSTC_BOOTSTRAP lets the installed stable toolchain
# accept them (no other toolchain can be fetched here).
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --quiet
export RUSTC_BOOTSTRAP=1
cargo fuzz run control -- -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048
