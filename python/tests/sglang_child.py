"""A separate SGLang process for the two-process HiCache test.

``python sglang_child.py SOCKET NAMESPACE``: for each pool kind (MHA, MLA) and layout
(page_first, page_first_direct), build SGLang's host pool, fill it from a seed, create
``MaruStorage`` through SGLang's ``StorageBackendFactory`` and store pages 3, 1, 4, 5, 9, 2
(not contiguous, not in order) with ``batch_set_v1``; print a line "RESULT <JSON>" with, per
combination, what ``batch_set_v1`` returned and the SHA-256 of each page's bytes; exit.
"""

from __future__ import annotations

import json
import sys

import sglang_util as su

PAGES = [3, 1, 4, 5, 9, 2]
COMBOS = [(kind, layout) for kind in ("mha", "mla") for layout in ("page_first", "page_first_direct")]


def main(argv: list) -> int:
    socket, namespace = argv[1], argv[2]
    out = {}
    for seed, (kind, layout) in enumerate(COMBOS):
        host = su.host_pool(kind, layout)
        su.fill(host, seed)
        backend = su.make_backend(su.maru_extra(socket, namespace), host, mla=kind == "mla")
        keys = su.page_keys(f"{kind}-{layout}", len(PAGES))
        stored = backend.batch_set_v1(keys, su.indices(PAGES))
        out[f"{kind}/{layout}"] = {"stored": stored, "digests": su.page_digests(host, PAGES)}
        backend.close()
    print("RESULT", json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
