"""One SGLang instance on CPU with HiCache on maru, for the end-to-end test.

``python sglang_server_child.py SPEC_JSON``, SPEC: ``model`` (a model directory),
``socket`` and ``namespace`` (the marud and the namespace ``MaruStorage`` uses), ``prompt``
(token ids), ``max_new_tokens``, ``page_size``. Starts SGLang's engine (the runtime its HTTP
server wraps: tokenizer manager, scheduler with HiCache and its storage backend, detokenizer,
each in its process) on CPU with ``maru_sglang.MaruStorage`` as HiCache's L3 storage, loaded
the way SGLang loads third-party backends (``dynamic`` with module and class in the extra
config), generates greedily for the prompt, and prints "RESULT <JSON>": the output token ids
and the request's ``meta_info`` (``cached_tokens``, ``cached_tokens_details``). With
``wait_stored`` it then waits until the namespace holds that many entries (HiCache writes to
its storage in the background) before shutting the engine down.

The environment must carry ``SGLANG_USE_CPU_ENGINE=1`` and this directory's ``sglang_cpu``
on ``PYTHONPATH`` (what SGLang 0.5.23 lacks on CPU: sglang_cpu/sitecustomize.py).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list) -> int:
    spec = json.loads(argv[1])
    import sglang
    import maru

    extra = {
        "backend_name": "maru", "module_path": "maru_sglang", "class_name": "MaruStorage", "interface_v1": 1,
        "maru_server_url": f"unix://{spec['socket']}", "maru_namespace": spec["namespace"],
        "maru_pool_size": "16M",
    }
    engine = sglang.Engine(
        model_path=spec["model"], device="cpu", attention_backend="torch_native", dtype="bfloat16",
        skip_tokenizer_init=True, page_size=spec["page_size"], mem_fraction_static=0.05,
        max_total_tokens=spec.get("max_total_tokens", 4096), max_running_requests=4,
        chunked_prefill_size=-1, disable_overlap_schedule=True, random_seed=0, log_level="warning",
        enable_hierarchical_cache=True, hicache_size=1, hicache_mem_layout="page_first",
        hicache_io_backend="kernel", hicache_write_policy="write_through",
        hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    try:
        t0 = time.monotonic()
        out = engine.generate(input_ids=spec["prompt"],
                              sampling_params={"temperature": 0.0, "max_new_tokens": spec["max_new_tokens"],
                                               "ignore_eos": True})
        took = time.monotonic() - t0
        stored = None
        want = spec.get("wait_stored")
        if want:
            handler = maru.MaruHandler(maru.MaruConfig(socket_path=spec["socket"], namespace=spec["namespace"]))
            handler.connect()
            deadline = time.monotonic() + 120
            while True:
                stored = len(list(handler.list_keys()))
                if stored >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            handler.close()
        print("RESULT", json.dumps({"output_ids": out["output_ids"], "meta_info": {
            k: out["meta_info"].get(k) for k in ("cached_tokens", "cached_tokens_details", "prompt_tokens")},
            "seconds": took, "stored": stored}), flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
