"""SGLang's own storage kit drives hicache: the real radix cache, cache controller (its
prefetch and backup threads) and storage factory, through an L3 round trip.

The kit (`sglang.test.kits.unified_radix_cache`, in SGLang's wheel) builds a producer
tree that inserts a sequence, fills its KV with a marker, backs it up to the host pool and
writes it to L3, then a consumer tree that prefetches the sequence from L3 and loads it back
to its device pool. Its `_init_hicache` knows SGLang's `file` backend only; here the same
set-up attaches `--hicache-storage-backend dynamic` with hicache's extra config instead. On
the CPU, `tests.support.sglang_cpu.install_kit_shims` replaces only the device<->host copies.
"""

from __future__ import annotations

import json
import unittest

import pytest

pytest.importorskip("sglang", reason="install tests/engine_integration/requirements-sglang.txt")
pytest.importorskip("torchvision", reason="pip install --no-deps torchvision==0.28.0 (.ci/run)")

from tests.support import sglang_cpu  # noqa: E402

pytest.importorskip("datasets", reason="SGLang's test kit imports it: requirements-sglang.txt")
sglang_cpu.install_kit_shims()

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import match_prefix  # noqa: E402
from sglang.test.kits.unified_radix_cache.storage import (  # noqa: E402
    UnifiedRadixCacheStorageFixtures,
)


class HicacheKit(UnifiedRadixCacheStorageFixtures):
    """The kit's storage fixtures with hicache as the L3 (`storage_dir` -> file:// URL)."""

    host_layout = "page_first"

    def _init_hicache(self, cache, *, storage_backend=None, storage_dir=None, **kwargs):
        if storage_backend != "file":
            return super()._init_hicache(cache, storage_backend=storage_backend, **kwargs)
        override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        override.__enter__()
        self.addCleanup(override.__exit__, None, None, None)
        extra = {
            "backend_name": "hicache", "module_path": "engine_integration.sglang.storage",
            "class_name": "HiCacheSGLangStorage", "interface_v1": 1,
            "url": f"file://{storage_dir}/hicache?capacity=64MiB", "model_id": "kit/model",
        }  # fmt: skip
        threshold = kwargs.pop("prefetch_threshold", None)
        if threshold is not None:
            extra["prefetch_threshold"] = threshold
        kwargs.pop("storage_extra", None)
        # The kit's own set-up, given the dynamic backend and this JSON in place of "file".
        original = super()._init_hicache
        import sglang.test.kits.unified_radix_cache.mixins as mixins

        server_args = mixins.ServerArgs

        def with_hicache(*args, **server_kwargs):
            server_kwargs["hicache_storage_backend"] = "dynamic"
            server_kwargs["hicache_storage_backend_extra_config"] = json.dumps(extra)
            server_kwargs["hicache_mem_layout"] = self.host_layout
            return server_args(*args, **server_kwargs)

        mixins.ServerArgs = with_hicache
        try:
            original(cache, storage_backend=None, **kwargs)
        finally:
            mixins.ServerArgs = server_args
        cache.cache_controller.prefetch_capacity_limit = max(
            cache.cache_controller.prefetch_capacity_limit,
            cache.cache_controller.mem_pool_host.size,
        )
        self.addCleanup(cache.cache_controller._stop_storage_threads)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_sglang_kit_l3_round_trip_through_hicache(page_size, layout):
    class Case(HicacheKit, unittest.TestCase):
        host_layout = layout
        cfg = CacheConfig(page_size=page_size, components=(ComponentType.FULL,),
                          num_layers=2, full_attention_layer_ids=(0, 1), head_dim=8)  # fmt: skip

        def runTest(self):
            storage_dir = self._make_storage_dir()
            seq = self._make_seq(1, 3)
            expected = self._l3_produce(storage_dir, seq, marker=3.0)
            consumer, allocator, _ = self._l3_consumer(storage_dir)
            backend = consumer.cache_controller.storage_backend
            assert type(backend).__name__ == "HiCacheSGLangStorage"
            assert consumer.cache_controller.mem_pool_host.layout == layout
            self._consume_prefetch(consumer, seq, CacheRequestHandle("kit", 0))
            match = match_prefix(consumer, seq)
            assert match.host_hit_length == len(seq)
            loaded = self._load_back_node(consumer, match.last_host_node)
            assert loaded is not None and len(loaded) == len(seq)
            got = self._snapshot_full_kv(
                allocator, consumer.path_device_indices(match.last_host_node)
            )
            assert all((g == e).all() for g, e in zip(got, expected, strict=True))
            assert backend.backend_stats().num_hits > 0

    result = unittest.TestResult()
    Case().run(result)
    assert not result.errors and not result.failures, (result.errors + result.failures)[0][1]
