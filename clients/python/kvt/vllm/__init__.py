"""kvt.vllm: family-wide prefix reuse inside vLLM (V1) through kvtd.

Configure an engine with

    KVTransferConfig(kv_connector="KvtConnector", kv_connector_module_path="kvt.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"kvtd_address": "127.0.0.1:50051",
                                                "model_name": "kvt-tiny-L"})

and every request publishes its KV to kvtd and reuses a prefix another family member published,
translated (docs/VLLM.md). Importing this package imports vllm; `import kvt` alone does not.
"""

from kvt.vllm.cpu_cores import keep_plain_reservation

# Before anything else: vLLM imports this package while validating an engine's configuration,
# before it binds the workers' cores (kvt/vllm/cpu_cores.py).
keep_plain_reservation()

from kvt.vllm.connector import (KvtConnector, KvtConnectorMetadata,  # noqa: E402
                                KvtConnectorStats, KvtWorkerMetadata,
                                parse_kv_transfer_params, validate_kv_transfer_params)
from kvt.vllm.paged import PagedLayout, gather_tokens, scatter_tokens  # noqa: E402

__all__ = ["KvtConnector", "PagedLayout", "KvtConnectorMetadata", "KvtConnectorStats",
           "KvtWorkerMetadata", "gather_tokens", "parse_kv_transfer_params", "scatter_tokens",
           "validate_kv_transfer_params"]
