#!/usr/bin/env bash
# Issue 18's GPU benchmark on a lent GPU machine (nothing can be fetched there): run from the
# repository root, with the marud and the package's wheel built here and carried along:
#
#   cargo build --release -p maru-daemon
#   maturin build --release -m python/Cargo.toml -o target/wheels
#   (on the GPU machine) bash python/bench/gpu_device.sh      # figures under $OUT
#
# The machine's python3 has torch; the wheel (abi3) is installed into a private directory.
# It runs the CUDA tests of the tensor verbs, then gpu.py on a memfs pool and on a file pool.
set -euo pipefail
out=${OUT:-/tmp/maru-gpu}
mkdir -p "$out"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
wheel=$(ls target/wheels/maru-*.whl | head -n1)
python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel"
export PYTHONPATH=$site MARU_PLUGINS=none
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
MARUD=$PWD/target/release/marud python3 -m pytest -q -p no:cacheprovider python/tests/test_tensors.py \
    2>&1 | tail -n 5 | tee "$out/tests.txt"
for pool in memfs file; do
    python3 python/bench/gpu.py --marud target/release/marud --pool "$pool" \
        --json "$out/gpu-$pool.json" 2>&1 | tee "$out/gpu-$pool.txt"
done
