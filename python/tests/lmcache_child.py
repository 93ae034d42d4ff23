"""A separate LMCache process for the two-process tests.

``python lmcache_child.py BACKEND store SOCKET NS N``: build an LMCache StorageManager with
the maru storage plugin (BACKEND ``plugin``) or LMCache's built-in MaruBackend (``builtin``:
``maru_path`` set, no LocalCPUBackend, namespace NS through ``$MARU_NAMESPACE``), store
chunks 0..N-1, wait until they are stored, print a line "RESULT <JSON list of their SHA-256
digests>", exit (the process and its LMCache are gone afterwards).

``python lmcache_child.py BACKEND load SOCKET NS N``: a fresh StorageManager; look the
chunks up (``batched_contains``) and load them through LMCache's retrieval
path (``batched_get``); print "RESULT <JSON>" with the hit count, the digests, shapes and
dtypes.
"""

from __future__ import annotations

import json
import os
import sys

import lmcache_util as lu


def main(argv: list) -> int:
    backend, mode, socket, ns, n = argv[1], argv[2], argv[3], argv[4], int(argv[5])
    if backend == "plugin":
        config, name = lu.make_config(plugin_socket=socket, plugin_namespace=ns), "maru"
    else:
        os.environ["MARU_NAMESPACE"] = ns
        config, name = lu.make_builtin_config(socket), "MaruBackend"
    sm = lu.make_manager(config)
    try:
        be = sm.storage_backends[name]
        if mode == "store":
            keys = lu.put_chunks(sm, range(n))
            if backend == "plugin":
                assert be.wait_for_puts(60)
            else:
                lu.wait_for_backend_puts(be, keys, 60)
            print("RESULT", json.dumps([lu.digest(lu.chunk_tensor(i)) for i in range(n)]))
            return 0
        keys = [lu.key(i) for i in range(n)]
        hits, mapping = sm.batched_contains(keys)
        objs = sm.batched_get(keys, location=name)
        out = {
            "hits": hits,
            "backends": sorted(mapping),
            "digests": [lu.digest(o.tensor) if o is not None else None for o in objs],
            "shapes": [list(o.tensor.shape) if o is not None else None for o in objs],
            "dtypes": [str(o.tensor.dtype) if o is not None else None for o in objs],
        }
        lu.release(objs)
        print("RESULT", json.dumps(out))
        return 0
    finally:
        sm.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
