"""How the vLLM connector is configured: from vLLM's configs to a `HiCacheConfig`, a
`KVLayout` and the namespaces that key its pages.

Settings come from `kv_connector_extra_config` under the names of the `HICACHE_*`
variables, lower-cased and without the prefix (`l2_size` is HICACHE_L2_SIZE, `l3_url` is
HICACHE_L3_URL, ...), on top of any `HICACHE_*` variables in the environment; both go
through `HiCacheConfig.from_env`, the one place their defaults and checks live. Three keys
are the connector's own: `page_size` (tokens per hicache page), `model_id` (the model
part of every page key; default vLLM's model name) and `load_async` (load a hit whole
before the step that uses it, the request waiting in vLLM meanwhile, instead of layer by
layer inside the step; always on for a model of several KV groups). L1's device and the
layout are vLLM's (its KV tensors say them), so `device` and `layout` are refused.

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
CONNECTOR_KEYS = ("page_size", "model_id", "load_async")


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector reads from `kv_connector_extra_config` and the environment."""

    page_size: int
    model_id: str
    environ: Mapping[str, str]  # HICACHE_* name -> text, for HiCacheConfig.from_env
    load_async: bool = False  # load whole before the step (a model of several groups: always)


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
    load_async = extra.get("load_async", False)
    if not isinstance(load_async, bool):
        raise ValueError(
            f"kv_connector_extra_config.load_async must be true or false, got {load_async!r}"
        )
    return ConnectorSettings(page_size, model_id, variables, load_async)


def _as_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ValueError(
        f"kv_connector_extra_config.{key} must be a string, number or boolean, got {value!r}"
    )


def kv_layout(spec, num_layers: int, page_size: int) -> KVLayout:
    """hicache's layout for vLLM's attention spec: K and V of every KV head per token, or
    for MLA one latent of `head_size` values (vLLM's spec does not split it into the
    compressed KV and the rope part, so the descriptor names it all `kv_lora_rank`)."""
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"HiCacheConnector: KV dtype {spec.dtype} is not one hicache stores")
    if type(spec).__name__ == "MLAAttentionSpec":
        return KVLayout(
            kind="mla",
            num_layers=num_layers,
            page_size=page_size,
            dtype=dtype,
            kv_lora_rank=spec.head_size,
            rope_dim=0,
        )
    return KVLayout(
        kind="mha",
        num_layers=num_layers,
        page_size=page_size,
        dtype=dtype,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
    )


def cache_config(
    settings: ConnectorSettings,
    layout: KVLayout,
    device: str,
    step_tokens: int,
    l2_share: float = 1.0,
) -> HiCacheConfig:
    """The HiCache config: the settings, on vLLM's device, with L1 sized for staging and
    `l2_share` of the L2 budget (a model's KV groups split it by their bytes per token)."""
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
    l2 = dataclasses.replace(config.l2, budget_bytes=int(config.l2.budget_bytes * l2_share))
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


def group_model_id(model_id: str, group: int, num_groups: int) -> str:
    """The model part of a KV group's keys: the model's own id when it has one group."""
    return model_id if num_groups == 1 else f"{model_id}#kv{group}"


def namespace_for(
    model_id: str, layout: KVLayout, *, rank: int = 0, world_size: int = 1, extra_key: str = ""
) -> Namespace:
    """The namespace of a request's pages on one worker.

    Model and layout (dtype, layers, page size, KV heads, head size) always; the rank of
    the shard when vLLM splits the KV over several tensor-parallel workers (each holds
    other heads); the request's `request_extra_key`. With one worker and no salt or LoRA
    this is the namespace hicache's own engine uses for the same model, and pages are
    shared with it. MLA's latent is the same on every rank: one namespace for all.
    """
    if world_size > 1 and layout.kind != "mla":
        model_id = f"{model_id}@rank{rank}of{world_size}"
    return Namespace(model_id=model_id, layout=layout.descriptor(), extra_key=extra_key)


# ---------------------------------------------------------------------- one cache a process


@dataclass
class SharedCache:
    """The HiCaches of one vLLM engine's worker (one per KV group), and its lookup for the
    scheduler."""

    caches: list  # hicache.controller.HiCache, per KV group
    lookup: Any  # engine_integration.vllm.lookup.ModelLookup
    events: Any = None  # a deque of vLLM KV events (events.py), when vLLM publishes them
    users: int = 0

    @property
    def cache(self):
        """The first group's cache (the only one of a model with one group)."""
        return self.caches[0]


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
