#!/usr/bin/env bash
# Regenerates cluster/src/etcd/pb/ (etcd's messages and gRPC clients) from the .proto files
# beside this script. Needs only cargo: the compiler is protox, a crate. The generated code is
# committed, so a build of maru never runs this; CI runs it with --check to catch drift.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/../src/etcd/pb"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
CARGO_TARGET_DIR="${MARU_GEN_TARGET:-$here/../../target/etcd-gen}" \
    cargo run --quiet --locked --manifest-path "$here/gen/Cargo.toml" -- "$here" "$tmp"
rustfmt --edition 2024 "$tmp"/*.rs
if [ "${1:-}" = --check ]; then
    diff -ru "$out" "$tmp" || { echo "cluster/src/etcd/pb/ is stale: run cluster/proto/regen.sh" >&2; exit 1; }
    echo "cluster/src/etcd/pb/ matches cluster/proto/*.proto"
else
    mkdir -p "$out"
    cp "$tmp"/*.rs "$out"/
    echo "regenerated $out"
fi
