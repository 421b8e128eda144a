"""Deprecated path of the vLLM connector: use `engine_integration.vllm.connector`.

Kept for one release so that `--kv-transfer-config` lines written for hicache 0.1
(`"kv_connector_module_path": "engine_integration.vllm_connector"`) keep working.
"""

import warnings

from engine_integration.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]

warnings.warn(
    "engine_integration.vllm_connector is deprecated and will be removed in the next release: "
    'set "kv_connector_module_path": "engine_integration.vllm.connector"',
    DeprecationWarning,
    stacklevel=2,
)
