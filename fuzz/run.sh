#!/usr/bin/env bash
# A bounded fuzzing run of the control protocol decoder and dispatcher (target `control`), or
# of the remote tier's control decoder (target `remote`).
#   fuzz/run.sh [SECONDS] [TARGET]   (default 60 s, control; doc/RELIABILITY.md's record: 600)
# cargo-fuzz needs nightly compiler flags; RUSTC_BOOTSTRAP lets the installed stable toolchain
# accept them (no other toolchain can be fetched here).
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
target="${2:-control}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --quiet
export RUSTC_BOOTSTRAP=1
cargo fuzz run "$target" -- -max_total_time="$secs" -max_len=4096 -rss_limit_mb=2048
