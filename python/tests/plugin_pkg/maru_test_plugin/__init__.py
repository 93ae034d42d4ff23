"""Handler plugins for maru's tests.

- ``Recorder`` appends one JSON line per hook call to the file ``$MARU_TEST_PLUGIN_LOG``;
- ``Broken`` raises while being built;
- ``Faulty`` raises in every hook.
"""

import json
import os


def _key(k):
    return k.decode("latin-1") if isinstance(k, bytes) else str(k)


class Recorder:
    def __init__(self):
        self.retrieves = 0

    def _log(self, **record):
        path = os.environ.get("MARU_TEST_PLUGIN_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_init(self, handler):
        self._log(hook="on_init", namespace=handler.config.namespace, connected=handler.connected)

    def on_batch_retrieve(self, handler, keys, results):
        self.retrieves += 1
        self._log(
            hook="on_batch_retrieve",
            keys=[_key(k) for k in keys],
            results=[None if r is None else r.view.tobytes().decode("latin-1") for r in results],
        )

    def on_close(self, handler):
        self._log(hook="on_close", connected=handler.connected)

    def contribute_stats(self, handler):
        self._log(hook="contribute_stats")
        return {"batch_retrieves": self.retrieves}


class Broken:
    def __init__(self):
        raise RuntimeError("the broken plugin fails to build")


class Faulty:
    def on_init(self, handler):
        raise RuntimeError("on_init fails")

    def on_batch_retrieve(self, handler, keys, results):
        raise RuntimeError("on_batch_retrieve fails")

    def on_close(self, handler):
        raise RuntimeError("on_close fails")

    def contribute_stats(self, handler):
        raise RuntimeError("contribute_stats fails")
