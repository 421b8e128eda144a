"""A `HiCache` over the simulator's executor: links of 1 GB/s without latency, a simulated
L3 (`SimulatedL3`), no torch, and a clock the test moves (`settle`)."""

from __future__ import annotations

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.simulate.executor import Link, Links, VirtualExecutor
from hicache.simulate.l3 import SimulatedL3
from tiers.layout import KVLayout

LAYOUT = KVLayout(
    kind="mha", num_layers=1, page_size=4, dtype="float32", num_kv_heads=1, head_dim=2
)


def virtual_cache(
    store: SimulatedL3, *, l1_pages: int, l2_pages: int, policy: PolicyConfig
) -> tuple[HiCache, VirtualExecutor]:
    links = Links(
        device_to_host=Link("d2h", 1e9),
        host_to_device=Link("h2d", 1e9),
        host_latency_s=0.0,
        l3_write=(Link("out", 1e9),),
        l3_read=(Link("in", 1e9),),
        l3_latency_s=0.0,
    )
    executor = VirtualExecutor(
        num_device_pages=l1_pages,
        num_host_pages=l2_pages,
        page_bytes=LAYOUT.bytes_per_page,
        links=links,
        stores={"l3": store},
    )
    config = HiCacheConfig(
        layout=LAYOUT,
        l1=L1Config(num_pages=l1_pages),
        l2=L2Config(
            budget_bytes=l2_pages * LAYOUT.bytes_per_page, reserve_bytes=0, pin_memory=False
        ),
        l3=L3Config(url="sim://l3"),
        policy=policy,
    )
    return HiCache(config, executor), executor


def settle(cache: HiCache, executor: VirtualExecutor) -> None:
    """Run the clock until every transfer in flight is done and applied."""
    while (done_s := executor.next_done_s()) is not None:
        executor.advance_to(done_s)
        cache.poll()
