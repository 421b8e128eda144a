"""The test harness's own promises about the servers it starts: a paused server is hung in
every thread by the time `pause` returns, and a paused one still stops; a free port is not
one the kernel hands out to outgoing connections, nor another xdist worker's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.servers import ServerProcess, all_threads_stopped, free_port

# Many runnable threads at the lowest priority: the thread picked to take a SIGSTOP often
# waits for a core while the others run on, the window a bare `kill` returns into.
_BUSY = """
import os, threading
os.nice(19)
def spin():
    while True:
        pass
for _ in range(5):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""


@pytest.fixture
def busy() -> ServerProcess:
    server = ServerProcess()
    server.proc = subprocess.Popen([sys.executable, "-c", _BUSY])
    yield server
    server.stop()
    assert server.proc.poll() is not None


def test_pause_returns_only_when_every_thread_is_stopped(busy):
    for _ in range(100):
        busy.pause()
        assert all_threads_stopped(busy.proc.pid)
        busy.resume()


def test_paused_goes_on_after_its_block_however_it_ends(busy):
    with pytest.raises(ZeroDivisionError), busy.paused():
        assert all_threads_stopped(busy.proc.pid)
        1 / 0  # noqa: B018
    assert not all_threads_stopped(busy.proc.pid)


def test_a_paused_server_stops(busy):
    busy.pause()
    busy.stop()  # a stopped process hears no TERM until it is continued
    assert busy.proc.returncode == -15


def test_free_ports_are_outside_the_ephemeral_range_and_the_other_workers(monkeypatch):
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        low, high = (int(field) for field in ranges.read().split())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    ports = [free_port() for _ in range(300)]
    buses = [free_port(with_cluster_bus=True) for _ in range(100)]
    assert all(not low <= port <= high and port % 3 == 1 for port in ports + buses)
    assert all(not low <= bus + 10000 <= high and bus + 10000 <= 65535 for bus in buses)
