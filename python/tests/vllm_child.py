"""One vLLM instance (a process of its own) for the vLLM tests and benchmark.

``python vllm_child.py SPEC_JSON``: SPEC is a JSON object with ``model`` (a model directory,
see vllm_util.make_model), ``connector`` (``maru``: MaruKVConnector; ``example``: vLLM's
ExampleConnector with ``storage`` as its shared_storage_path; ``none``), ``socket`` and
``namespace`` (maru; ``role``: its kv_role, default ``kv_both``; ``async_load``,
``async_store``: the connector's maru_async_load and maru_async_store; ``load_gate``: a path,
the connector's first retrieve waits at it as a prompt's ``wait`` does (vllm_gated.py); with
``remote``: {``url``, ``token``}, a memory node's pool instead of the socket's marud), and
``prompts``: a list of {``name``, ``parts``: [[tokens, seed], ...], ``wait`` (optional: a path; before this prompt the child creates ``<wait>.ready`` and waits
until ``<wait>`` exists)} (a prompt is its parts' words concatenated, so two prompts can
share a prefix; ``salt``, optional: the prompt's ``cache_salt``); with ``together``, the prompts go to vLLM in one call (scheduled in the same
steps, no times measured) instead of one after the other. For each
prompt, in order, it measures the time to first token (a generate of one token, vLLM's own
prefix cache off; the median of ``repeat`` runs, default 1) and then generates 8 tokens
greedily; it prints one line
``RESULT {name: {ttft, tokens, cached}}``.

With ``concurrent`` ({``decode``: [tokens, seed], ``load``: [tokens, seed], ``after``,
``tokens``, ``rounds``}) it measures instead what a request arriving with a long prompt costs
a request already decoding: each round, a decoding request (``tokens`` tokens greedily, its
end ignored) runs alone for ``after`` tokens, then the long one comes (one token); the engine
is stepped by hand and every token's arrival timed. ``RESULT {"concurrent": {ttft, cached,
gap_before, gap_max, stalled}}`` with per-round lists: the long request's time to first token,
the tokens it loaded, the decoding request's median gap between tokens before the long one
came, its longest gap from then until one token after the long one's first, and the time
it went without a token over that window beyond its usual gap.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # vLLM on CPU: gloo on loopback
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


def main() -> int:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CACHE_ROOT", spec.get("cache_root", "/tmp/maru-vllm-cache"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_util
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kt = None
    if spec["connector"] == "maru":
        extra = {"maru_pool_size": "64M", "maru_namespace": spec["namespace"],
                 "maru_async_load": bool(spec.get("async_load")), "maru_async_store": bool(spec.get("async_store"))}
        remote = spec.get("remote")
        if remote:
            extra |= {
                "maru_storage_backend": "remote",
                "maru_remote_url": remote["url"],
                "maru_remote_token": remote["token"],
                "maru_remote_timeout_s": 5,
                "maru_remote_retry_s": 2,
                "maru_node_id": remote.get("node", "worker"),
            }
        else:
            extra["maru_server_url"] = f"unix://{spec['socket']}"
        if spec.get("load_gate"):
            os.environ["MARU_VLLM_LOAD_GATE"] = spec["load_gate"]  # vLLM's engine process inherits it
        kt = KVTransferConfig(
            kv_connector="GatedMaruKVConnector" if spec.get("load_gate") else "MaruKVConnector",
            kv_connector_module_path="vllm_gated" if spec.get("load_gate") else "maru_vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    elif spec["connector"] == "example":
        kt = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["storage"]},
        )
    llm = LLM(
        model=spec["model"], enforce_eager=True, kv_transfer_config=kt,
        max_model_len=vllm_util.MAX_LEN, enable_prefix_caching=False, seed=0,
        # On CPU this is the share of RAM vLLM checks is free; the KV cache itself is sized
        # below (the tiny model's 8K tokens take 8 MiB).
        gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 << 20,
        # A prompt is prefilled in one step: vLLM's ExampleConnector saves what one step
        # computed under the whole prompt's name, so it needs that (MaruKVConnector does not).
        max_num_batched_tokens=vllm_util.MAX_LEN,
    )
    out = {}
    if spec.get("concurrent"):
        out["concurrent"] = concurrent(llm, spec["concurrent"], vllm_util, SamplingParams)
    elif spec.get("together"):
        texts = [" ".join(vllm_util.prompt(n, seed) for n, seed in p["parts"]) for p in spec["prompts"]]
        first = llm.generate(texts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        full = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for p, f, g in zip(spec["prompts"], first, full):
            out[p["name"]] = {"ttft": None, "tokens": list(g.outputs[0].token_ids), "cached": f.num_cached_tokens,
                              "prompt_tokens": len(f.prompt_token_ids)}
    for p in [] if spec.get("together") or spec.get("concurrent") else spec["prompts"]:
        text = " ".join(vllm_util.prompt(n, seed) for n, seed in p["parts"])
        if p.get("salt"):
            text = {"prompt": text, "cache_salt": p["salt"]}
        if p.get("wait"):
            vllm_util.barrier(p["wait"])
        times = []
        for _ in range(int(spec.get("repeat", 1))):
            t0 = time.perf_counter()
            first = llm.generate([text], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        ttft = sorted(times)[len(times) // 2]
        full = llm.generate([text], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        out[p["name"]] = {
            "ttft": ttft,
            "tokens": list(full[0].outputs[0].token_ids),
            "cached": first[0].num_cached_tokens,
            "prompt_tokens": len(first[0].prompt_token_ids),
        }
    # The result goes to a file of its own: vLLM's engine process writes to the same stdout,
    # and its lines can land inside ours.
    path = os.environ.get("MARU_VLLM_RESULT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f)
    print("RESULT", json.dumps(out), flush=True)
    return 0


def concurrent(llm, c: dict, vllm_util, SamplingParams) -> dict:
    """See the module's documentation: rounds of a decoding request met by a long one."""
    eng = llm.llm_engine
    decode = vllm_util.prompt(*c["decode"])
    long = vllm_util.prompt(*c["load"])
    llm.generate([decode], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    res = {"ttft": [], "cached": [], "gap_before": [], "gap_max": [], "stalled": []}
    for r in range(int(c.get("rounds", 1))):
        eng.add_request(f"decode-{r}", decode,
                        SamplingParams(temperature=0, max_tokens=int(c["tokens"]), ignore_eos=True))
        ticks, came, first, cached = [], None, None, 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                n = len(o.outputs[0].token_ids)
                if o.request_id.startswith("decode") and n > len(ticks):
                    ticks.extend([now] * (n - len(ticks)))
                elif o.request_id.startswith("long") and n and first is None:
                    first, cached = now, o.num_cached_tokens or 0
            if came is None and len(ticks) >= int(c["after"]):
                eng.add_request(f"long-{r}", long, SamplingParams(temperature=0, max_tokens=1))
                came = time.perf_counter()
        assert came is not None and first is not None, "the long request never answered"
        before = [b - a for a, b in zip(ticks, ticks[1:]) if b <= came]
        usual = sorted(before)[len(before) // 2]
        # From the last token before the long request came to the first after its answer.
        last = max(t for t in ticks if t <= came)
        after = min((t for t in ticks if t > first), default=ticks[-1])
        window = [t for t in ticks if last <= t <= after]
        gaps = [b - a for a, b in zip(window, window[1:])]
        res["ttft"].append(first - came)
        res["cached"].append(cached)
        res["gap_before"].append(usual)
        res["gap_max"].append(max(gaps))
        res["stalled"].append(sum(max(0.0, g - usual) for g in gaps))
    return res


if __name__ == "__main__":
    sys.exit(main())
