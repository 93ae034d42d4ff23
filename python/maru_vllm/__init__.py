"""maru for vLLM: ``MaruKVConnector``, a KV connector for vLLM's ``KVConnectorBase_V1``.

vLLM loads it by module path, with the original design's configuration::

    --kv-transfer-config '{"kv_connector": "MaruKVConnector",
                           "kv_connector_module_path": "maru_vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"maru_server_url": "maru://localhost:5555"}}'

Importing this package needs vLLM and torch (it is the connector module).
"""

from maru_vllm.connector import MaruConnectorMetadata, MaruKVConnector

__all__ = ["MaruKVConnector", "MaruConnectorMetadata"]
