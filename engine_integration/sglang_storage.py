"""Deprecated path of the SGLang storage backend: use `engine_integration.sglang.storage`.

Kept for one release so that `--hicache-storage-backend-extra-config` lines written for
hicache 0.1 (`"module_path": "engine_integration.sglang_storage"`) keep working.
"""

import warnings

from engine_integration.sglang.storage import HiCacheSGLangStorage

__all__ = ["HiCacheSGLangStorage"]

warnings.warn(
    "engine_integration.sglang_storage is deprecated and will be removed in the next release: "
    'set "module_path": "engine_integration.sglang.storage"',
    DeprecationWarning,
    stacklevel=2,
)
