"""The virtual-time executor and the simulated L3, on their own."""

from __future__ import annotations

import pytest

from hicache.ops import BackupOp, LoadOp, OpKind, PrefetchOp, WriteL3Op
from hicache.simulate.errors import SimulationError
from hicache.simulate.executor import Link, Links, VirtualExecutor, reserve
from hicache.simulate.l3 import SimulatedL3

PAGE = 1000  # bytes per page


def make_executor(store=None, *, chunk_pages=2, host_gbps=1.0, nic_gbps=1.0):
    links = Links(
        device_to_host=Link("d2h", host_gbps * 1e9),
        host_to_device=Link("h2d", host_gbps * 1e9),
        host_latency_s=1e-6,
        l3_write=(Link("out", nic_gbps * 1e9),),
        l3_read=(Link("in", nic_gbps * 1e9),),
        l3_latency_s=1e-4,
    )
    executor = VirtualExecutor(
        num_device_pages=8,
        num_host_pages=8,
        page_bytes=PAGE,
        links=links,
        stores={"shared": store} if store else {},
        prefetch_chunk_pages=chunk_pages,
    )
    if store:
        executor.attach_l3("sim://shared")
    return executor


def backup(num_pages):
    return BackupOp(kind=OpKind.BACKUP, num_pages=num_pages, num_bytes=num_pages * PAGE)


def test_an_op_takes_bytes_over_bandwidth_plus_latency_and_queues_behind_the_last():
    executor = make_executor()
    executor.advance_to(1.0)
    first, second = backup(1000), backup(1000)  # 1 MB each at 1 GB/s: 1 ms
    executor.submit(first)
    executor.submit(second)
    assert executor.poll() == []
    executor.advance_to(1.0 + 1e-3 + 1e-6)
    assert executor.poll() == [first]
    assert first.done and first.finished_s == pytest.approx(1.001001)
    executor.advance_to(1.0021)
    assert executor.poll() == [second]
    assert second.finished_s == pytest.approx(1.002001)


def test_directions_do_not_contend():
    executor = make_executor()
    load = LoadOp(kind=OpKind.LOAD, num_pages=1000, num_bytes=1000 * PAGE)
    executor.submit(backup(1000))
    executor.submit(load)
    assert executor.loads_done_s == pytest.approx(1e-3 + 1e-6)


def test_wait_moves_the_clock_to_the_end_or_the_timeout():
    executor = make_executor()
    op = backup(1000)
    executor.submit(op)
    assert executor.wait(op, 1e-4) is False
    assert executor.now() == pytest.approx(1e-4)
    assert executor.wait(op, None) is True
    assert executor.now() == pytest.approx(1.001e-3)
    assert not op.done  # poll hands it back
    assert executor.poll() == [op] and op.done


def test_the_clock_never_goes_back():
    executor = make_executor()
    executor.advance_to(5.0)
    executor.advance_to(4.0)
    assert executor.now() == 5.0


def test_shared_links_take_the_slower_rate_and_stay_busy_for_their_share():
    nic, store = Link("nic", 2e9), Link("store", 1e9)
    start, end = reserve((nic, store), 0.0, 10**9)
    assert (start, end) == (0.0, 1.0)
    assert nic.busy_until_s == 0.5 and store.busy_until_s == 1.0
    start, _ = reserve((Link("other nic", 2e9), store), 0.2, 10**9)
    assert start == 1.0  # waits for the shared store


def test_an_l3_write_becomes_visible_when_it_completes():
    store = SimulatedL3(capacity_pages=10)
    executor = make_executor(store)
    keys = [b"a", b"b", b"c"]
    op = WriteL3Op(kind=OpKind.WRITE_L3, num_pages=3, num_bytes=3 * PAGE, keys=keys)
    executor.submit(op)
    done = 3 * PAGE / 1e9 + 1e-4
    assert store.exists(keys, done - 1e-9) == 0
    assert store.exists(keys, done) == 3
    assert executor.l3_exists(keys, timeout_s=1.0) == 0  # at now + one round trip: not yet
    executor.advance_to(done)
    assert executor.l3_exists(keys, timeout_s=1.0) == 3
    executor.poll()
    assert op.done and op.num_written == 3


def test_a_prefetch_delivers_pages_chunk_by_chunk_and_only_those_l3_holds():
    store = SimulatedL3(capacity_pages=10)
    store.put([b"p0", b"p1", b"p2", b"p3", b"p4"], visible_s=0.0)
    executor = make_executor(store, chunk_pages=2, nic_gbps=1e-3)  # 1 ms per page
    keys = [b"p0", b"p1", b"p2", b"p3", b"p4", b"absent", b"p6"]
    op = PrefetchOp(kind=OpKind.PREFETCH, num_pages=7, num_bytes=7 * PAGE, keys=keys)
    executor.submit(op)
    ready = []
    for t_ms in (1.5, 2.2, 4.3, 6.0, 7.0):
        executor.advance_to(t_ms / 1e3)
        executor.poll()
        ready.append(op.num_ready)
    # chunk c arrives after (c + 1) round trips of 0.1 ms and its pages at 1 ms each
    assert ready == [0, 2, 4, 5, 5]
    assert op.done  # the read stopped at the chunk with the missing page


def test_simulated_l3_evicts_the_least_recently_used_and_reads_refresh():
    store = SimulatedL3(capacity_pages=3)
    store.put([b"a", b"b", b"c"], visible_s=1.0)
    assert store.read([b"a"], now_s=2.0) == 1  # a is now the most recent
    assert store.exists([b"b"], now_s=2.0) == 1  # exists does not refresh
    store.put([b"d"], visible_s=3.0)
    assert store.exists([b"d", b"a", b"c"], now_s=3.0) == 3
    assert store.exists([b"b"], now_s=3.0) == 0
    assert store.stats().num_evictions == 1
    with pytest.raises(ValueError):
        SimulatedL3(capacity_pages=0)


def test_a_lagging_clock_does_not_see_a_write_from_its_future():
    store = SimulatedL3(capacity_pages=3)
    store.put([b"a"], visible_s=5.0)
    assert store.exists([b"a"], now_s=6.0) == 1  # applied by an instance at t = 6
    assert store.exists([b"a"], now_s=4.0) == 0  # another instance, still at t = 4


def test_only_sim_urls_attach():
    executor = make_executor(SimulatedL3(4))
    with pytest.raises(SimulationError, match="sim://NAME"):
        executor.attach_l3("memory://?capacity=1GiB")
    with pytest.raises(SimulationError, match="no simulated L3 named 'elsewhere'"):
        executor.attach_l3("sim://elsewhere")
    executor.attach_l3(None)
    assert not executor.has_l3
