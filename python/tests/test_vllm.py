"""vLLM (CPU build) with KV shared through maru, in two processes: MaruKVConnector, and
vLLM's own ExampleConnector writing files under /maru (a client nobody here wrote).

Instance A computes a prompt and saves its KV; instance B, another process started after A
exited, finds it: its ``num_cached_tokens`` covers the shared prefix and its greedy output
equals A's. Times to first token are printed, not asserted (the benchmark
python/bench/vllm_bench.py compares them); what is asserted is what was loaded and what was
generated. Runs where vLLM is installed (python/ci.sh's vLLM environment).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import Marud, child_env  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import vllm_util  # noqa: E402

SHARED = [[6912, 1]]  # A's prompt: 6,912 tokens
PREFIX_ONLY = [[4096, 1], [700, 2]]  # shares its first 4,096 tokens with A's (the first words of seed 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(vllm_util.make_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    """vLLM's cache directory (VLLM_CACHE_ROOT), kept out of $HOME."""
    return str(tmp_path_factory.mktemp("vllm-cache"))


def run_instance(spec: dict) -> dict:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    out = vllm_util.run_child(sys.executable, spec, env)
    if out.returncode != 0 or out.result is None:
        errors = "\n".join(line for line in out.stdout.splitlines() if "Error" in line or "ERROR" in line)
        pytest.fail(f"vLLM instance failed:\n{errors[-5000:]}\n...\n{out.stdout[-2000:]}")
    result = json.loads(out.result)
    print(spec["connector"], {k: (v["ttft"], v["cached"], v["prompt_tokens"]) for k, v in result.items()})
    return result


def prefix_of(parts_a, parts_b) -> int:
    """Tokens two prompts share at their start."""
    a = " ".join(vllm_util.prompt(n, s) for n, s in parts_a).split()
    b = " ".join(vllm_util.prompt(n, s) for n, s in parts_b).split()
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_maru_connector_loads_the_prefix_another_instance_computed(
    marud: Marud, namespace: str, model_dir: str, cache_root: str
) -> None:
    base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(marud.socket),
            "namespace": namespace}
    a = run_instance(base | {"prompts": [{"name": "shared", "parts": SHARED}]})
    assert a["shared"]["cached"] == 0
    chunks = len(os.listdir(marud.mount / namespace))
    assert chunks == 6912 // 256, f"{chunks} chunks stored"  # every full chunk of the prompt
    b = run_instance(base | {"prompts": [
        {"name": "uncached", "parts": [[6912, 3]]},
        {"name": "shared", "parts": SHARED},
        {"name": "prefix", "parts": PREFIX_ONLY},
    ]})
    assert b["uncached"]["cached"] == 0
    # B loads every block of A's prompt but the one holding the last token (vLLM computes it).
    assert b["shared"]["cached"] == (6912 - 1) // 128 * 128
    assert b["shared"]["tokens"] == a["shared"]["tokens"]
    # A prompt sharing only a prefix with A's reuses the chunks of that prefix.
    shared = prefix_of(SHARED, PREFIX_ONLY)
    assert shared >= 4096
    assert b["prefix"]["cached"] == shared // 256 * 256


def test_example_connector_runs_unmodified_on_maru(marud: Marud, namespace: str, model_dir: str, cache_root: str) -> None:
    storage = marud.mount / namespace
    storage.mkdir()
    base = {"model": model_dir, "cache_root": cache_root, "connector": "example", "storage": str(storage)}
    a = run_instance(base | {"prompts": [{"name": "shared", "parts": SHARED}]})
    files = list(storage.rglob("*.safetensors"))
    assert files, "ExampleConnector wrote nothing under /maru"
    b = run_instance(base | {"prompts": [{"name": "shared", "parts": SHARED}]})
    assert b["shared"]["cached"] > 6000
    assert b["shared"]["tokens"] == a["shared"]["tokens"]
