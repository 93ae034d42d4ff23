"""maru for SGLang: ``MaruStorage``, a HiCache storage backend (SGLang's L3 tier).

SGLang loads it as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "maru", "module_path": "maru_sglang",
        "class_name": "MaruStorage", "interface_v1": 1, "maru_server_url": "maru://localhost:5555"}'

See doc/SGLANG.md. The backend needs torch and SGLang; importing this package does not.
"""

__all__ = ["MaruStorage"]


def __getattr__(name: str):
    if name == "MaruStorage":
        from maru_sglang.storage import MaruStorage

        return MaruStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
