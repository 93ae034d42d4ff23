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
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import pytest

pytest.importorskip("vllm")

from conftest import Marud, child_env, start_marud  # noqa: E402
from remote_util import TOKEN, GpuNodes, MemoryNode, require_nixl  # noqa: E402

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


def run_instance(spec: dict, env: Optional[dict] = None, prefix: Sequence[str] = (), log: Optional[list] = None) -> dict:
    """Run one vLLM instance (vllm_child.py); ``env``: more environment, ``prefix``: a
    command it runs under (a GPU node's ``ip netns exec``); ``log``: a list its output is
    appended to."""
    env = child_env() | (env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    out = vllm_util.run_child(sys.executable, spec, env, prefix)
    if log is not None:
        log.append(out.stdout)
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


def test_disaggregated_prefill_a_producer_saves_a_consumer_loads(
    marud: Marud, namespace: str, model_dir: str, cache_root: str
) -> None:
    """1P1D: prefill instance A (kv_producer) computes and saves, never loads (the same prompt
    twice is computed twice); decode instance B (kv_consumer) loads A's prompt (its cached
    tokens cover it, its output is A's), computes a prompt nobody stored, and saves nothing."""
    base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(marud.socket),
            "namespace": namespace}
    a = run_instance(base | {"role": "kv_producer", "prompts": [
        {"name": "shared", "parts": SHARED}, {"name": "again", "parts": SHARED}]})
    assert (a["shared"]["cached"], a["again"]["cached"]) == (0, 0)
    assert a["again"]["tokens"] == a["shared"]["tokens"]
    stored = sorted(os.listdir(marud.mount / namespace))
    assert len(stored) == 6912 // 256
    b = run_instance(base | {"role": "kv_consumer", "prompts": [
        {"name": "shared", "parts": SHARED}, {"name": "fresh", "parts": [[6912, 5]]}]})
    assert b["shared"]["cached"] == (6912 - 1) // 128 * 128
    assert b["shared"]["tokens"] == a["shared"]["tokens"]
    assert b["fresh"]["cached"] == 0
    assert sorted(os.listdir(marud.mount / namespace)) == stored, "the consumer saved"


def test_a_chunk_two_requests_of_one_step_compute_is_stored(
    marud: Marud, namespace: str, model_dir: str, cache_root: str
) -> None:
    """Two requests with one prompt in the same step (a burst sharing a system prompt): each
    chunk is saved once, not by both (a save planned twice was counted twice and never
    published, its pool memory held until the end)."""
    base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(marud.socket),
            "namespace": namespace}
    same = [[1024, 7]]
    a = run_instance(base | {"together": True, "prompts": [
        {"name": "one", "parts": same}, {"name": "two", "parts": same}]})
    assert a["one"]["tokens"] == a["two"]["tokens"]
    assert len(os.listdir(marud.mount / namespace)) == 1024 // 256, "every chunk stored once"


def test_a_cache_salt_keeps_tenants_apart(marud: Marud, namespace: str, model_dir: str, cache_root: str) -> None:
    """A prompt salted for one tenant is loaded by that tenant only: another salt, or none,
    computes it (vLLM's prefix cache keeps salts apart; the connector's keys do too)."""
    base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(marud.socket),
            "namespace": namespace}
    same = [[1024, 8]]
    a = run_instance(base | {"prompts": [{"name": "a", "parts": same, "salt": "tenant-a"}]})
    assert a["a"]["cached"] == 0
    b = run_instance(base | {"prompts": [
        {"name": "other", "parts": same, "salt": "tenant-b"},
        {"name": "unsalted", "parts": same},
        {"name": "same", "parts": same, "salt": "tenant-a"},
    ]})
    assert b["other"]["cached"] == 0 and b["unsalted"]["cached"] == 0
    assert b["same"]["cached"] == (1024 - 1) // 128 * 128
    assert b["same"]["tokens"] == a["a"]["tokens"]


def test_asynchronous_saves_and_loads_share_what_synchronous_ones_do(
    marud: Marud, namespace: str, model_dir: str, cache_root: str
) -> None:
    """maru_async_store and maru_async_load. 1P1D: producer A saves on its save thread (every
    chunk is in when it has exited); consumer B, given a prompt nobody stored and A's in one
    call, computes the first (nothing found) while its load thread loads the second, whose
    request waits (cached tokens cover A's prompt, output equals A's). Then C, kv_both with both modes, loads A's prompt and saves a new one,
    whose requests end before their saves do (vLLM keeps their blocks until C reports them)."""
    base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(marud.socket),
            "namespace": namespace}
    a = run_instance(base | {"role": "kv_producer", "async_store": True, "prompts": [{"name": "shared", "parts": SHARED}]})
    stored = sorted(os.listdir(marud.mount / namespace))
    assert len(stored) == 6912 // 256
    b = run_instance(base | {"role": "kv_consumer", "async_load": True, "together": True, "prompts": [
        {"name": "fresh", "parts": [[6912, 5]]}, {"name": "shared", "parts": SHARED}]})
    assert b["fresh"]["cached"] == 0
    assert b["shared"]["cached"] == (6912 - 1) // 128 * 128
    assert b["shared"]["tokens"] == a["shared"]["tokens"]
    assert sorted(os.listdir(marud.mount / namespace)) == stored, "the consumer saved"
    c = run_instance(base | {"async_load": True, "async_store": True, "prompts": [
        {"name": "shared", "parts": SHARED}, {"name": "new", "parts": [[4096, 6]]}]})
    assert c["shared"]["cached"] == (6912 - 1) // 128 * 128
    assert c["shared"]["tokens"] == a["shared"]["tokens"]
    assert c["new"]["cached"] == 0
    assert len(os.listdir(marud.mount / namespace)) == len(stored) + 4096 // 256
    # What C saved asynchronously loads as well: vLLM's own output for the prompt, from its
    # chunks. (Not compared with C's own: the blocks C keeps for its saves put its next run
    # of the prompt in other blocks, and on some CPUs (AMD EPYC, 2 vCPUs) vLLM's CPU kernels
    # then part from the same tokens at a near tie, the saves copying nothing or not.)
    new = [{"name": "new", "parts": [[4096, 6]]}]
    d = run_instance(base | {"role": "kv_consumer", "prompts": new})
    assert d["new"]["cached"] == (4096 - 1) // 128 * 128
    plain = run_instance({"model": model_dir, "cache_root": cache_root, "connector": "none", "prompts": new})
    assert d["new"]["tokens"] == plain["new"]["tokens"]


def test_a_marud_killed_during_an_asynchronous_load_makes_the_consumer_recompute(
    model_dir: str, cache_root: str, tmp_path: Path
) -> None:
    """Consumer B has looked A's prompt up (its chunks held) when marud is killed, before B
    retrieves them: the load fails, vLLM recomputes (its policy is recompute), and B's output
    is A's."""
    d = start_marud(tmp_path / "marud")
    gate = str(tmp_path / "load-gate")
    try:
        base = {"model": model_dir, "cache_root": cache_root, "connector": "maru", "socket": str(d.socket),
                "namespace": "killed"}
        a = run_instance(base | {"async_store": True, "prompts": [{"name": "shared", "parts": SHARED}]})
        results: dict = {}
        log: list = []

        def b() -> None:
            try:
                results["b"] = run_instance(
                    base | {"role": "kv_consumer", "async_load": True, "load_gate": gate, "together": True,
                            "prompts": [{"name": "fresh", "parts": [[2048, 7]]}, {"name": "shared", "parts": SHARED}]},
                    log=log)
            except BaseException as e:  # pytest.fail's exception included: raised below
                results["error"] = e

        t = threading.Thread(target=b)
        t.start()
        deadline = time.monotonic() + 900
        while not os.path.exists(gate + ".ready") and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(gate + ".ready"), "B never loaded"
        d.proc.kill()
        d.proc.wait()
        Path(gate).touch()
        t.join()
        if "error" in results:
            raise results["error"]
        assert results["b"]["shared"]["tokens"] == a["shared"]["tokens"]
        assert "load of" in log[0] and "Recovered from KV load failure" in log[0], log[0][-3000:]
    finally:
        Path(gate).touch()
        d.stop()


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


def test_a_request_resumed_after_its_preemption_has_its_load_planned(
    marud: Marud, namespace: str, model_dir: str
) -> None:
    """vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``, or a feature the V2 runner lacks)
    schedules a request resumed after its preemption among the cached requests, with all its
    blocks anew. Its load must be planned there, as a new request's is (it was planned for new
    requests only: the resumed request ran on blocks nothing loaded). The connector's
    scheduler side, driven with vLLM's own request and scheduler output."""
    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    import maru
    from maru_vllm import MaruKVConnector

    transfer = KVTransferConfig(
        kv_connector="MaruKVConnector", kv_connector_module_path="maru_vllm", kv_role="kv_both",
        kv_connector_extra_config={"maru_server_url": f"unix://{marud.socket}", "maru_namespace": namespace},
    )
    config = EngineArgs(model=model_dir, kv_transfer_config=transfer, max_model_len=vllm_util.MAX_LEN,
                        enforce_eager=True).create_engine_config()
    block = config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block, num_kv_heads=vllm_util.KV_HEADS,
                             head_size=vllm_util.HIDDEN // vllm_util.HEADS, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(vllm_util.LAYERS)]
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
    connector = MaruKVConnector(config, KVConnectorRole.SCHEDULER, kv)
    tokens = [3 + i * 7 % 4000 for i in range(1000)]
    request = Request("r", tokens, SamplingParams(temperature=0, max_tokens=8), None)
    keys = connector.chunk_keys(tokens, request)
    assert len(keys) == 1000 // 256
    # Another instance stored every full chunk of the prompt.
    h = maru.MaruHandler(marud.config(namespace))
    assert h.connect()
    try:
        for k in keys:
            assert h.put(k, b"kv")
    finally:
        h.close()
    stored = len(keys) * 256

    def step(new=(), cached: Optional[CachedRequestData] = None, preempted=(), scheduled: int = 0):
        return connector.build_connector_meta(SchedulerOutput(
            scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
            num_scheduled_tokens={"r": scheduled} if scheduled else {}, total_num_scheduled_tokens=scheduled,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
            free_encoder_mm_hashes=[], preempted_req_ids=set(preempted),
        ))

    def loaded(meta, blocks: List[int]) -> None:
        assert list(meta.loads) == ["r"], meta
        assert [c.key for c in meta.loads["r"]] == keys
        got = [b for c in meta.loads["r"] for b in c.blocks.tolist()]
        assert got == blocks[: stored // block], got

    # First scheduled as a new request, on blocks 0..: the stored chunks are loaded into them.
    first = list(range(-(-len(tokens) // block)))
    assert connector.get_num_new_matched_tokens(request, 0) == (stored, False)
    connector.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in first],)), stored)
    loaded(step(new=[NewRequestData.from_request(request, (first,))], scheduled=len(tokens) - stored), first)
    # Preempted: vLLM frees its blocks. Resumed later, on other blocks, among the cached requests.
    step(preempted=["r"])
    again = [b + 32 for b in first]
    assert connector.get_num_new_matched_tokens(request, 0) == (stored, False)
    connector.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in again],)), stored)
    resumed = CachedRequestData(
        req_ids=["r"], resumed_req_ids={"r"}, new_token_ids=[], all_token_ids={"r": list(tokens)},
        new_block_ids=[(again,)], num_computed_tokens=[stored], num_output_tokens=[0],
    )
    loaded(step(cached=resumed, scheduled=len(tokens) - stored), again)
    connector.request_finished(request, again)


def test_connector_configuration_is_checked(model_dir: str) -> None:
    from maru_vllm.connector import handler_config

    entry = 1 << 20
    local = handler_config({"maru_storage_backend": "cpu", "maru_cache_namespace": "llama"}, entry)
    assert not local.is_remote and local.namespace == "llama"
    remote = handler_config({"maru_storage_backend": "remote", "maru_remote_url": "tcp://m:7860",
                             "maru_remote_staging_size": "256M", "maru_remote_timeout_s": 3,
                             "maru_remote_retry_s": 4, "maru_remote_token": "t" * 20, "maru_node_id": "gpu7"}, entry)
    assert remote.is_remote and remote.remote_url == "tcp://m:7860" and remote.pool_size == 256 << 20
    assert (remote.remote_transfer_timeout_s, remote.remote_retry_s, remote.node_id) == (3.0, 4.0, "gpu7")
    assert handler_config({"maru_engine_id": "engine-3", "maru_async_load": False}, entry).instance_id == "engine-3"
    assert handler_config({"maru_async_load": True, "maru_async_store": "true"}, entry).namespace == "vllm"
    for extra, message in [
        ({"maru_storage_backend": "nvme"}, "not one of"),
        ({"maru_storage_backend": "remote"}, "maru_remote_url"),
        ({"maru_storage_backend": "remote", "maru_remote_url": "tcp://m:1", "maru_server_url": "maru://x:1"},
         "maru_server_url"),
        ({"maru_remote_url": "tcp://m:1"}, "only apply to maru_storage_backend 'remote'"),
        ({"maru_namespace": "a", "maru_cache_namespace": "b"}, "two namespaces"),
        ({"maru_server_url": "maru://otherhost.invalid:5555"}, "names another host"),
    ]:
        with pytest.raises(ValueError, match=message):
            handler_config(extra, entry)


@pytest.fixture(scope="module")
def remote_nodes() -> Iterator[tuple]:
    """A memory node (marud with its door, this host's namespace) and two GPU nodes (network
    namespaces joined to it by veth pairs)."""
    require_nixl()
    with GpuNodes(2) as gpus:
        node = MemoryNode(Path(tempfile.mkdtemp(prefix="maru-pytest-vllm-remote-")), host=gpus.host_addrs[0],
                          env=os.environ | gpus.host_ucx_env)
        node.start()
        try:
            yield node, gpus
        finally:
            node.marud.stop()


def test_remote_instances_share_kv_through_a_memory_node_and_recompute_without_it(
    remote_nodes: tuple, model_dir: str, cache_root: str, tmp_path: Path
) -> None:
    """A on GPU node 1 stores through the memory node's pool; B on GPU node 2 loads it (its
    cached tokens cover A's prompt, its output is A's); then the memory node dies and B's next
    prompt, which A stored too, is computed: same output, nothing loaded, no hang."""
    node, gpus = remote_nodes
    ns = f"vllm-remote-{os.getpid()}"

    def spec(i: int, prompts: list) -> dict:
        return {"model": model_dir, "cache_root": cache_root, "connector": "maru", "namespace": ns,
                "remote": {"url": node.url, "token": TOKEN, "node": f"gpu{i + 1}"}, "prompts": prompts}

    second = [[6912, 4]]
    a = run_instance(spec(0, [{"name": "shared", "parts": SHARED}, {"name": "second", "parts": second}]),
                     gpus.node_ucx_env(0), gpus.exec_prefix(0))
    assert a["shared"]["cached"] == 0
    # The memory node sees the chunks as entries of its own pool.
    assert len(os.listdir(node.marud.mount / ns)) == 2 * (6912 // 256)

    gate = str(tmp_path / "memory-node-killed")
    results: dict = {}

    def b() -> None:
        try:
            results["b"] = run_instance(
                spec(1, [{"name": "shared", "parts": SHARED}, {"name": "second", "parts": second, "wait": gate}]),
                gpus.node_ucx_env(1), gpus.exec_prefix(1))
        except BaseException as e:  # pytest.fail's exception included: raised below
            results["error"] = e

    t = threading.Thread(target=b)
    t.start()
    try:
        deadline = time.monotonic() + 900
        while not os.path.exists(gate + ".ready") and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(gate + ".ready"), "B never reached its second prompt"
        node.kill()
    finally:
        Path(gate).touch()
        t.join()
    if "error" in results:
        raise results["error"]
    b_out = results["b"]
    assert b_out["shared"]["cached"] == (6912 - 1) // 128 * 128
    assert b_out["shared"]["tokens"] == a["shared"]["tokens"]
    assert b_out["second"]["cached"] == 0
    assert b_out["second"]["tokens"] == a["second"]["tokens"]
