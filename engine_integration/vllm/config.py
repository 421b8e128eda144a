"""How the vLLM connector is configured: from vLLM's configs to a `HiCacheConfig`, a
`KVLayout` and the namespaces that key its pages.

Settings come from `kv_connector_extra_config` under the names of the `HICACHE_*`
variables, lower-cased and without the prefix (`l2_size` is HICACHE_L2_SIZE, `l3_url` is
HICACHE_L3_URL, ...), on top of any `HICACHE_*` variables in the environment; both go
through `HiCacheConfig.from_env`, the one place their defaults and checks live. Two keys
are the connector's own: `page_size` (tokens per hicache page) and `model_id` (the model
part of every page key; default vLLM's model name). L1's device and the layout are vLLM's
(its KV tensors say them), so `device` and `layout` are refused.

vLLM's scheduler and its worker each construct a connector; with one worker in the
scheduler's process (vLLM's `uni` executor, world size 1) they share one `HiCache`, found
here by the engine id both are given (otherwise the scheduler asks the workers over a
socket: `engine_integration.vllm.lookup`).

No torch here: this module reads vLLM's config objects and builds hicache's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.config import ENV_VARIABLES, HiCacheConfig
from radix.keys import Namespace
from tiers.layout import DTYPE_BYTES, KVLayout

DEFAULT_PAGE_SIZE = 64
# L1 staging pages when `l1_pages` is not given: one 16K-token prefix, or a step's token
# budget if that is larger (see the README's vLLM section for what L1 holds).
DEFAULT_L1_TOKENS = 16384

# extra-config key -> HICACHE_ variable; vLLM decides the device and the layout.
SET_BY_VLLM = ("HICACHE_LAYOUT", "HICACHE_DEVICE")
EXTRA_KEYS = {
    variable.removeprefix("HICACHE_").lower(): variable
    for variable in ENV_VARIABLES
    if variable not in SET_BY_VLLM
}
CONNECTOR_KEYS = ("page_size", "model_id")


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector reads from `kv_connector_extra_config` and the environment."""

    page_size: int
    model_id: str
    environ: Mapping[str, str]  # HICACHE_* name -> text, for HiCacheConfig.from_env


def read_settings(
    extra: Mapping[str, Any], default_model_id: str, environ: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Settings from the extra config over the `HICACHE_*` variables of `environ`."""
    environ = os.environ if environ is None else environ
    unknown = sorted(set(extra) - set(EXTRA_KEYS) - set(CONNECTOR_KEYS))
    if unknown:
        refused = [key for key in unknown if f"HICACHE_{key.upper()}" in SET_BY_VLLM]
        why = f" ({', '.join(refused)}: set by vLLM)" if refused else ""
        raise ValueError(
            f"kv_connector_extra_config: unknown keys {unknown}{why}; known: "
            f"{sorted([*EXTRA_KEYS, *CONNECTOR_KEYS])}"
        )
    variables = {
        name: value
        for name, value in environ.items()
        if name.startswith("HICACHE_") and name not in SET_BY_VLLM
    }
    for key, value in extra.items():
        if key in EXTRA_KEYS:
            variables[EXTRA_KEYS[key]] = _as_text(key, value)
    page_size = extra.get("page_size", DEFAULT_PAGE_SIZE)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(
            f"kv_connector_extra_config.page_size must be an int >= 1, got {page_size!r}"
        )
    model_id = extra.get("model_id", default_model_id)
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"kv_connector_extra_config.model_id must be a name, got {model_id!r}")
    return ConnectorSettings(page_size=page_size, model_id=model_id, environ=variables)


def _as_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ValueError(
        f"kv_connector_extra_config.{key} must be a string, number or boolean, got {value!r}"
    )


def attention_group(kv_cache_config) -> tuple[Any, list[str]]:
    """The one full-attention KV cache group's spec and layer names, or an error naming
    what this connector does not handle."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"HiCacheConnector handles one KV cache group (full attention), this model has "
            f"{len(groups)}; start vLLM with --disable-hybrid-kv-cache-manager"
        )
    spec = groups[0].kv_cache_spec
    problems = []
    if type(spec).__name__ != "FullAttentionSpec":
        problems.append(f"spec {type(spec).__name__} (only FullAttentionSpec)")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        problems.append(f"head_size_v {spec.head_size_v} != head_size {spec.head_size}")
    for name, plain in (("num_head_slots", None), ("state_content_bytes", None)):
        if getattr(spec, name, plain) != plain:
            problems.append(f"{name}={getattr(spec, name)!r} (packed pages)")
    if getattr(spec, "tokens_per_state", 1) != 1:
        problems.append(f"tokens_per_state={spec.tokens_per_state!r}")
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        problems.append(f"kv_quant_mode={mode} (scaled KV)")
    if problems:
        raise ValueError("HiCacheConnector cannot cache this KV: " + "; ".join(problems))
    return spec, list(groups[0].layer_names)


def kv_layout(spec, num_layers: int, page_size: int) -> KVLayout:
    """hicache's layout for vLLM's attention spec: K and V of every KV head, per token."""
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"HiCacheConnector: KV dtype {spec.dtype} is not one hicache stores")
    return KVLayout(
        kind="mha",
        num_layers=num_layers,
        page_size=page_size,
        dtype=dtype,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
    )


def cache_config(
    settings: ConnectorSettings, layout: KVLayout, device: str, step_tokens: int
) -> HiCacheConfig:
    """The HiCache config: the settings, on vLLM's device, with L1 sized for staging."""
    config = HiCacheConfig.from_env(layout, environ=settings.environ)
    if not config.l2.budget_bytes:
        raise ValueError(
            "HiCacheConnector needs an L2 pool: set l2_size in kv_connector_extra_config "
            "(or HICACHE_L2_SIZE), e.g. 64GiB"
        )
    num_pages = config.l1.num_pages or math.ceil(
        max(DEFAULT_L1_TOKENS, step_tokens) / layout.page_size
    )
    l1 = dataclasses.replace(config.l1, device=device, num_pages=num_pages)
    l2 = config.l2
    if device == "cpu" and "HICACHE_L2_PIN" not in settings.environ:
        l2 = dataclasses.replace(l2, pin_memory=False)  # nothing to pin for on a CPU
    return config.replace(l1=l1, l2=l2)


def request_extra_key(request) -> str:
    """The part of a request's namespace that is its own: its LoRA adapter and its
    `cache_salt` (so a salted request shares pages only with requests of the same salt)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None and getattr(lora, "lora_name", None):
        parts.append(f"lora={lora.lora_name}")
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    return ";".join(parts)


def namespace_for(
    model_id: str, layout: KVLayout, *, rank: int = 0, world_size: int = 1, extra_key: str = ""
) -> Namespace:
    """The namespace of a request's pages on one worker.

    Model and layout (dtype, layers, page size, KV heads, head size) always; the rank of
    the shard when vLLM splits the KV over several tensor-parallel workers (each holds
    other heads); the request's `request_extra_key`. With one worker and no salt or LoRA
    this is the namespace hicache's own engine uses for the same model, and pages are
    shared with it.
    """
    if world_size > 1:
        model_id = f"{model_id}@rank{rank}of{world_size}"
    return Namespace(model_id=model_id, layout=layout.descriptor(), extra_key=extra_key)


# ---------------------------------------------------------------------- one cache a process


@dataclass
class SharedCache:
    """The HiCache of one vLLM engine's worker, and its lookup for the scheduler."""

    cache: Any  # hicache.controller.HiCache
    lookup: Any  # engine_integration.vllm.lookup.CacheLookup
    users: int = 0


_shared: dict[str, SharedCache] = {}
_shared_lock = threading.Lock()


def publish(engine_id: str, shared: SharedCache) -> SharedCache:
    with _shared_lock:
        if engine_id in _shared:
            raise ValueError(f"HiCacheConnector: engine {engine_id!r} already has a cache")
        shared.users += 1
        _shared[engine_id] = shared
        return shared


def find(engine_id: str) -> SharedCache | None:
    """The engine's cache, taking a use of it (give it back with `let_go`)."""
    with _shared_lock:
        shared = _shared.get(engine_id)
        if shared is not None:
            shared.users += 1
        return shared


def let_go(engine_id: str, shared: SharedCache) -> bool:
    """Give back one use; True when it was the last (the caller closes the cache)."""
    with _shared_lock:
        shared.users -= 1
        if shared.users > 0:
            return False
        if _shared.get(engine_id) is shared:
            del _shared[engine_id]
        return True
