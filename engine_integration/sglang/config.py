"""What SGLang's storage config says to the L3 backend: the extra config's settings
(`StorageSettings`) and the part of each namespace that tells one rank's KV from another's
(`shard_of`, with the head slices of `tp_lcm_size`). `storage.py` calls them when SGLang
builds the backend and as each host pool is registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from hicache.config import backend_environment
from storage_backends import BackendConfigError
from storage_backends.options import with_option

URL_VARIABLE = "HICACHE_L3_URL"
# Keys of the extra config that SGLang reads itself (it removes its prefetch_* keys first).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
OWN_KEYS = frozenset({"url", "model_id"})


@dataclass(frozen=True)
class StorageSettings:
    """What the extra config (and the environment) says.

    url:      any hicache L3 URL; from the extra config's "url", else $HICACHE_L3_URL; with
              $HICACHE_L3_SECRET_FILE as its `secret_file` (the tenant's MAC), where set.
    model_id: the model name keys are namespaced by; default SGLang's own (served) name.
    """

    url: str
    model_id: str

    @classmethod
    def from_storage_config(
        cls, config: HiCacheStorageConfig, environ: Mapping[str, str] | None = None
    ) -> StorageSettings:
        extra = config.extra_config if config.extra_config is not None else {}
        if not isinstance(extra, Mapping):
            raise BackendConfigError(
                f"--hicache-storage-backend-extra-config must be a JSON object, got "
                f"{type(extra).__name__}"
            )
        unknown = sorted(set(extra) - SGLANG_KEYS - OWN_KEYS)
        if unknown:
            raise BackendConfigError(
                f"extra config: unknown key(s) {', '.join(map(repr, unknown))}; hicache reads "
                f"{', '.join(sorted(OWN_KEYS))} (SGLang: {', '.join(sorted(SGLANG_KEYS))})"
            )
        try:
            env = backend_environment(environ)
        except ValueError as exc:
            raise BackendConfigError(f"environment: {exc}") from None
        url = extra.get("url", env.get("url"))
        if url is None:
            raise BackendConfigError(
                f"extra config: 'url' is missing (or set {URL_VARIABLE}), e.g. "
                '"url": "redis://127.0.0.1:6379/0"'
            )
        if not isinstance(url, str) or "://" not in url:
            raise BackendConfigError(f"extra config: 'url' must be a backend URL, got {url!r}")
        if "secret_file" in env:
            url = with_option(url, "secret_file", env["secret_file"])
        model_id = extra.get("model_id", config.model_name)
        if not isinstance(model_id, str) or not model_id:
            raise BackendConfigError(
                "extra config: 'model_id' is needed (SGLang passed no model name), got "
                f"{model_id!r}"
            )
        return cls(url=url, model_id=model_id)


def head_slices(config: HiCacheStorageConfig) -> int:
    """How many objects of heads each page is stored as: SGLang's `tp_lcm_size` (the least
    common multiple of the tp sizes that share the store) over this instance's tp size, so
    that each object holds the heads of one rank at tp_lcm_size. 1 without tp_lcm_size and
    for MLA, whose KV every rank holds whole (tp is not in its keys: shared already)."""
    lcm = config.tp_lcm_size
    if not lcm or config.is_mla_model:
        return 1
    if type(lcm) is not int or lcm < 1 or lcm % config.tp_size:
        raise BackendConfigError(
            f"extra config: tp_lcm_size={lcm!r} must be a multiple of tp_size={config.tp_size}"
        )
    return lcm // config.tp_size


def shard_of(
    config: HiCacheStorageConfig, *, tp_sharded: bool = False, head_slice: int | None = None
) -> str:
    """The part of the namespace that tells one rank's KV from another's.

    MLA KV is the same on every tp rank (SGLang lets one writer store it): tp is left out,
    unless `tp_sharded` (an extra pool split by tp rank even for an MLA model: Mamba state).
    With `head_slice` (MHA KV under tp_lcm_size), the rank named is the one at tp_lcm_size
    that holds that slice of this rank's heads: `tp=rank*slices+slice/tp_lcm_size`.
    """
    if config.dcp_size > 1:
        raise BackendConfigError(
            f"dcp_size={config.dcp_size}: decode context parallelism is not supported"
        )
    slices = head_slices(config)
    replicated = config.is_mla_model and not tp_sharded
    if head_slice is not None and not replicated and config.tp_lcm_size:
        tp = f"tp={config.tp_rank * slices + head_slice}/{config.tp_size * slices}"
    else:
        tp = f"tp={config.tp_rank}/{config.tp_size}"
    parts = [] if replicated else [tp]
    parts.append(f"pp={config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp={config.attn_cp_rank}/{config.attn_cp_size}")
    return ";".join(parts)
