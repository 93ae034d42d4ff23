"""A separate LMCache process using LMCache's built-in MaruBackend (``maru_path``).

``python lmcache_builtin_child.py store SOCKET N``: a StorageManager with ``maru_path``
set and no LocalCPUBackend; allocate chunks 0..N-1 (in pool memory), fill and
``batched_put`` them, wait until stored, print "RESULT <JSON digests>", exit.

``python lmcache_builtin_child.py load SOCKET N``: a fresh StorageManager; look the chunks
up and load them through LMCache's retrieval path; print "RESULT <JSON>" with the hit
count, digests, shapes and dtypes. The namespace is ``$MARU_NAMESPACE``.
"""

from __future__ import annotations

import json
import sys

import lmcache_util as lu


def main(argv: list) -> int:
    mode, socket, n = argv[1], argv[2], int(argv[3])
    sm = lu.make_manager(lu.make_builtin_config(socket))
    try:
        backend = sm.storage_backends["MaruBackend"]
        if mode == "store":
            keys = lu.put_chunks(sm, range(n))
            lu.wait_for_backend_puts(backend, keys)
            print("RESULT", json.dumps([lu.digest(lu.chunk_tensor(i)) for i in range(n)]))
            return 0
        keys = [lu.key(i) for i in range(n)]
        hits, mapping = sm.batched_contains(keys)
        objs = sm.batched_get(keys, location="MaruBackend")
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
