"""MaruKVConnector whose first retrieve waits at a gate, for the vLLM tests: a test learns that
an instance has looked its prompt up and is about to load it (``<gate>.ready``), does
something to the store (kills marud), and opens the gate (creates ``<gate>``). The gate is
``$MARU_VLLM_LOAD_GATE`` (vllm_child.py's ``load_gate``); once open, retrieves pass."""

from __future__ import annotations

import os
from typing import Any, List

import vllm_util
from maru_vllm import MaruKVConnector


class GatedMaruKVConnector(MaruKVConnector):
    def _retrieve(self, h: Any, keys: List[str]) -> List[Any]:
        gate = os.environ.get("MARU_VLLM_LOAD_GATE")
        if gate and not os.path.exists(gate):
            vllm_util.barrier(gate)
        return super()._retrieve(h, keys)
