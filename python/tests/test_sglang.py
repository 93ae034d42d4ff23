"""SGLang's HiCache storage on maru (``maru_sglang.MaruStorage``), against SGLang's own classes.

The backend is made the way SGLang's cache controller makes it: ``StorageBackendFactory`` with
``dynamic`` and ``backend_name``/``module_path``/``class_name`` in a real
``HiCacheStorageConfig``'s extra config, then SGLang's host KV pool (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``, on CPU) registered. Pages move with the zero-copy interface (host
indices) and the plain one. Runs where SGLang is installed (python/ci.sh's SGLang
environment). The last test runs SGLang itself: two servers on CPU with HiCache on maru, the
second loading the first's prompt from maru (what SGLang lacks on CPU is supplied by
``sglang_cpu/``; doc/SGLANG.md, "SGLang itself, on CPU").
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# SGLang makes its compile caches' directory (~/.cache/sglang) when imported: the tests' go
# to a directory removed at exit (python/ci.sh gives the run's own).
_CACHE = tempfile.TemporaryDirectory(prefix="maru-tests-sglang-cache-")
os.environ.setdefault("SGLANG_CACHE_DIR", _CACHE.name)

pytest.importorskip("sglang")

import maru  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402

from conftest import Marud, child_env, start_marud  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import sglang_util as su  # noqa: E402
import vllm_util  # noqa: E402  (the tiny model)
from maru_sglang import MaruStorage  # noqa: E402

PAGES = [3, 1, 4, 5, 9, 2]  # what sglang_child.py stores
LOAD_AT = [20, 7, 12, 0, 30, 17]  # where the loading process puts them


def run_child(socket: str, namespace: str) -> dict:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    out = subprocess.run([sys.executable, str(TESTS / "sglang_child.py"), socket, namespace],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the storing process failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result from the storing process:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_the_factory_makes_maru_from_the_extra_config(marud: Marud, namespace: str) -> None:
    host = su.host_pool("mha", "page_first")
    backend = su.make_backend(su.maru_extra(str(marud.socket), namespace), host)
    try:
        assert isinstance(backend, MaruStorage) and isinstance(backend, HiCacheStorage)
        assert backend.mem_pool_host is host
        # The key names the model, the rank and the page's format.
        assert backend.key("ab") == "ab_test-org-tiny-model_0_1_page_first-float16-2x4x3x2x8"
    finally:
        backend.close()


def test_pages_stored_by_one_process_load_byte_equal_in_another(marud: Marud, namespace: str) -> None:
    stored = run_child(str(marud.socket), namespace)
    for seed, (kind, layout) in enumerate((k, lay) for k in ("mha", "mla") for lay in ("page_first", "page_first_direct")):
        want = stored[f"{kind}/{layout}"]
        assert want["stored"] == [True] * len(PAGES)
        host = su.host_pool(kind, layout)  # zeros
        backend = su.make_backend(su.maru_extra(str(marud.socket), namespace), host, mla=kind == "mla")
        try:
            keys = su.page_keys(f"{kind}-{layout}", len(PAGES))
            assert backend.batch_exists(keys) == len(PAGES)
            assert backend.batch_get_v1(keys, su.indices(LOAD_AT)) == [True] * len(PAGES)
            assert su.page_digests(host, LOAD_AT) == want["digests"], (kind, layout)
            # The pool around the loaded pages is untouched.
            others = [p for p in range(host.page_num) if p not in LOAD_AT]
            assert all(not host.get_data_page(p * su.PAGE).any() for p in others)
            # Stored again: nothing to do, still stored.
            assert backend.batch_set_v1(keys, su.indices(LOAD_AT)) == [True] * len(PAGES)
        finally:
            backend.close()


def test_mla_pages_are_shared_across_ranks_and_mha_pages_are_not(marud: Marud, namespace: str) -> None:
    extra = su.maru_extra(str(marud.socket), namespace)
    keys = su.page_keys("ranks", 3)
    for kind in ("mha", "mla"):
        src = su.host_pool(kind, "page_first")
        su.fill(src, 7)
        rank0 = su.make_backend(extra, src, mla=kind == "mla", tp_rank=0, tp_size=2)
        rank1 = su.make_backend(extra, su.host_pool(kind, "page_first"), mla=kind == "mla", tp_rank=1, tp_size=2)
        other_layout = su.make_backend(extra, su.host_pool(kind, "page_first_direct"), mla=kind == "mla",
                                       tp_rank=0, tp_size=2)
        other_model = su.make_backend(extra, su.host_pool(kind, "page_first"), mla=kind == "mla",
                                      tp_rank=0, tp_size=2, model="test-org/other-model")
        try:
            assert rank0.batch_set_v1(keys, su.indices([0, 1, 2])) == [True] * 3
            assert rank0.batch_exists(keys) == 3
            assert rank1.batch_exists(keys) == (3 if kind == "mla" else 0), kind
            assert other_layout.batch_exists(keys) == 0  # another page format is another key
            assert other_model.batch_exists(keys) == 0
            if kind == "mla":
                dst = rank1.mem_pool_host
                assert rank1.batch_get_v1(keys, su.indices([5, 6, 7])) == [True] * 3
                assert su.page_digests(dst, [5, 6, 7]) == su.page_digests(src, [0, 1, 2])
        finally:
            for b in (rank0, rank1, other_layout, other_model):
                b.close()


def test_batch_exists_counts_the_stored_prefix_and_loads_report_each_page(marud: Marud, namespace: str) -> None:
    host = su.host_pool("mha", "page_first_direct")
    su.fill(host, 3)
    backend = su.make_backend(su.maru_extra(str(marud.socket), namespace), host)
    try:
        keys = su.page_keys("prefix", 4)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1([keys[0], keys[1], keys[3]], su.indices([0, 1, 3])) == [True] * 3
        assert backend.batch_exists(keys) == 2
        assert backend.exists(keys[3]) and not backend.exists(keys[2])
        assert backend.batch_get_v1(keys, su.indices([10, 11, 12, 13])) == [True, True, False, True]
        assert su.page_digests(host, [10, 11, 13]) == su.page_digests(host, [0, 1, 3])
        assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], su.indices([])) == []
    finally:
        backend.close()


def test_the_plain_interface_moves_flat_pages_as_sglangs_generic_path_does(marud: Marud, namespace: str) -> None:
    host = su.host_pool("mha", "page_first")
    su.fill(host, 4)
    backend = su.make_backend(su.maru_extra(str(marud.socket), namespace, interface_v1=0), host)
    try:
        keys = su.page_keys("plain", 3)
        # The controller's _generic_page_set: flat data pages, batch_set.
        assert backend.batch_set(keys[:2], [host.get_data_page(p * su.PAGE) for p in (0, 1)])
        assert backend.set(keys[2], host.get_data_page(2 * su.PAGE))
        assert backend.batch_exists(keys) == 3 and backend.exists(keys[1])
        # The controller's _generic_page_get: dummy flat pages, batch_get, set_from_flat_data_page.
        dummies = [host.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, dummies)
        assert all(g is d for g, d in zip(got, dummies))
        for p, data in zip((20, 21, 22), got):
            host.set_from_flat_data_page(p * su.PAGE, data)
        assert su.page_digests(host, [20, 21, 22]) == su.page_digests(host, [0, 1, 2])
        one = backend.get(keys[1], host.get_dummy_flat_data_page())
        assert torch.equal(one, host.get_data_page(1 * su.PAGE))
        raw = backend.get(keys[0])  # no target: a new tensor of the page's bytes
        assert torch.equal(raw, host.get_data_page(0).contiguous().view(torch.uint8))
        missing = su.page_keys("absent", 1)[0]
        assert backend.get(missing, host.get_dummy_flat_data_page()) is None
        assert backend.batch_get([missing, keys[0]], [None, None])[0] is None
        # A target of another size is a miss, not a partial copy.
        assert backend.get(keys[0], torch.zeros(5, dtype=torch.float16)) is None
        backend.clear()
        assert backend.batch_exists(keys) == 0
    finally:
        backend.close()


def test_a_store_larger_than_the_pools_keeps_the_pages_that_fit(small_marud: Marud) -> None:
    # Pages of 1 MiB (64 tokens, 4 layers, 8 heads of 128, fp16); 80 of them in one call, into
    # a 64 MiB pool: the one allocation for all is refused, the pages that fit are stored.
    n, tokens = 80, 64
    host = su.host_pool("mha", "page_first", page=tokens, layers=4, heads=8, head_dim=128,
                        device_tokens=n * tokens)
    su.fill(host, 6)
    backend = su.make_backend(su.maru_extra(str(small_marud.socket), "full", maru_pool_size="32M"), host)
    try:
        keys = su.page_keys("full", n)
        stored = backend.batch_set_v1(keys, su.indices(range(n), page=tokens))
        fit = stored.count(True)
        assert 0 < fit < n and stored == [True] * fit + [False] * (n - fit)
        assert backend.batch_exists(keys) == fit
        assert backend.batch_get_v1(keys[:fit], su.indices(range(n, n + fit), page=tokens)) == [True] * fit
        assert su.page_digests(host, range(n, n + fit)) == su.page_digests(host, range(fit))
    finally:
        backend.close()


def test_an_unreachable_marud_gives_misses_not_exceptions() -> None:
    root = Path(tempfile.mkdtemp(prefix="maru-pytest-sglang-"))
    d = start_marud(root, pool_size="64M")
    host = su.host_pool("mha", "page_first")
    su.fill(host, 5)
    keys = su.page_keys("gone", 2)
    backend = su.make_backend(su.maru_extra(str(d.socket), "gone", maru_retry_s=3600, maru_pool_size="32M"), host)
    try:
        assert backend.batch_set_v1(keys, su.indices([0, 1])) == [True, True]
    finally:
        d.stop()  # marud goes away under a connected backend
    try:
        # New pages cannot be stored; the failed call drops the connection...
        fresh = su.page_keys("after", 2)
        before = host.kv_buffer.clone()
        assert backend.batch_set_v1(fresh, su.indices([2, 3])) == [False, False]
        # ...and from then on (maru_retry_s) every call is a miss, for every key.
        for ks in (keys, fresh):
            assert backend.batch_exists(ks) == 0
            assert backend.batch_get_v1(ks, su.indices([4, 5])) == [False, False]
            assert backend.batch_set_v1(ks, su.indices([0, 1])) == [False, False]
            assert backend.get(ks[0], host.get_dummy_flat_data_page()) is None
            assert backend.batch_get(ks, None) == [None, None]
            assert backend.set(ks[0], host.get_data_page(0)) is False
            assert backend.batch_set(ks, [host.get_data_page(0), host.get_data_page(4)]) is False
            assert backend.exists(ks[0]) is False
        assert torch.equal(host.kv_buffer, before)  # nothing was loaded
        backend.clear()
    finally:
        backend.close()
    assert not root.exists()

    # A marud that was never there: the backend is made, every call misses.
    never = su.make_backend(su.maru_extra(str(root / "no.sock"), "never"), host)
    try:
        assert never.batch_exists(keys) == 0
        assert never.batch_get_v1(keys, su.indices([2, 3])) == [False, False]
        assert never.batch_set_v1(keys, su.indices([0, 1])) == [False, False]
    finally:
        never.close()


@pytest.mark.parametrize("extra, message", [
    ({"maru_pool": "4G"}, "unknown key"),
    ({"maru_storage_backend": "remote"}, "not built for SGLang"),
    ({"maru_pool_size": "lots"}, "not a size"),
    ({"maru_timeout_ms": "soon"}, "maru_timeout_ms must be a number"),
    ({"maru_namespace": "a", "maru_cache_namespace": "b"}, "name two namespaces"),
    ({"maru_server_url": "tcp://elsewhere.example:5555"}, "names another host"),
])
def test_a_bad_configuration_is_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        su.make_backend(su.DYNAMIC | extra, None)


def test_host_pools_it_does_not_move_are_refused(marud: Marud, namespace: str) -> None:
    backend = su.make_backend(su.maru_extra(str(marud.socket), namespace), None)
    try:
        with pytest.raises(ValueError, match="layout 'page_head' is not supported"):
            backend.register_mem_pool_host(su.host_pool("mha", "page_head"))
        assert backend.batch_get_v1(["k"], su.indices([0])) == [False]  # no pool: misses
        # A hybrid model's other pools move through the v2 interface, which is not built.
        backend.register_mem_host_pool_v2(su.host_pool("mha", "page_first"), "kv")
        with pytest.raises(ValueError, match="mamba host pool"):
            backend.register_mem_host_pool_v2(object(), "mamba")
    finally:
        backend.close()


# -- SGLang itself ------------------------------------------------------------------------------

SERVER_PAGE = 16  # tokens per page of the servers (the tiny model's page is 32 KiB)


class SGLangServer:
    """``python -m sglang.launch_server`` on CPU with HiCache on maru, configured as
    doc/SGLANG.md says (``dynamic`` backend, ``maru_*`` keys in the extra config), serving
    ``model`` on a free loopback port; in a session of its own, killed with everything it
    started when the test is done with it."""

    def __init__(self, model: Path, marud_socket: Path, namespace: str, scratch: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        extra = su.maru_extra(str(marud_socket), namespace, maru_pool_size="16M")
        args = [
            "--model-path", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16",
            "--skip-tokenizer-init", "--skip-server-warmup", "--page-size", str(SERVER_PAGE),
            "--mem-fraction-static", "0.05", "--max-total-tokens", "4096", "--max-running-requests", "4",
            "--chunked-prefill-size", "-1", "--disable-overlap-schedule", "--random-seed", "0",
            "--log-level", "warning",
            "--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-mem-layout", "page_first",
            "--hicache-io-backend", "kernel", "--hicache-write-policy", "write_through",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
        ]
        env = child_env()
        env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TORCH_EXTENSIONS_DIR=str(scratch / "torch-ext"),
                   PATH=os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]]))
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "sglang_cpu"), env["PYTHONPATH"]])
        self.log = open(scratch / f"sglang-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *args], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> "SGLangServer":
        try:
            self._wait_ready(limit_s=600)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"SGLang exited with {self.proc.returncode}:\n{self.output()}"
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"SGLang did not answer on port {self.port} in {limit_s} s:\n{self.output()}")

    def generate(self, input_ids: list, max_new_tokens: int) -> dict:
        body = {"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                             "ignore_eos": True}}
        req = urllib.request.Request(self._url("/generate"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the processes it started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def wait_entries(marud_socket: Path, namespace: str, want: int, limit_s: float = 120) -> int:
    """How many entries ``namespace`` holds once it holds ``want`` (HiCache writes to its
    storage in the background), or after ``limit_s``."""
    handler = maru.MaruHandler(maru.MaruConfig(socket_path=str(marud_socket), namespace=namespace))
    handler.connect()
    try:
        deadline = time.monotonic() + limit_s
        while True:
            n = len(list(handler.list_keys()))
            if n >= want or time.monotonic() > deadline:
                return n
            time.sleep(0.1)
    finally:
        handler.close()


def test_a_second_sglang_server_loads_the_first_s_prompt_from_maru(marud: Marud, namespace: str,
                                                                   tmp_path: Path) -> None:
    model = vllm_util.make_model(tmp_path / "model")
    rng = random.Random(7)
    prompt = [rng.randrange(3, vllm_util.VOCAB) for _ in range(40 * SERVER_PAGE)]
    # A: nothing stored yet. Its prompt and the 7 generated tokens it computed the KV of make
    # 40 full pages, which HiCache writes through to maru (host pool, then storage).
    with SGLangServer(model, marud.socket, namespace, tmp_path) as server:
        a = server.generate(prompt, 8)
        assert wait_entries(marud.socket, namespace, 40) == 40, server.output()
    assert a["meta_info"]["cached_tokens"] == 0, a
    # B, a new server: its device and host pools are empty; HiCache finds the prompt's pages in
    # maru, prefetches them, and computes only what it could not load: SGLang computes a
    # prompt's last token in any case, so the last page (16 tokens) is computed.
    with SGLangServer(model, marud.socket, namespace, tmp_path) as server:
        b = server.generate(prompt, 8)
    loadable = (len(prompt) - 1) // SERVER_PAGE * SERVER_PAGE
    assert b["meta_info"]["cached_tokens"] == loadable, b
    assert b["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": loadable,
                                                       "storage_backend": "MaruStorage"}, b
    assert b["output_ids"] == a["output_ids"]
