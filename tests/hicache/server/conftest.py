"""Real `hicache serve` processes on loopback for the daemon's tests, stopped afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.daemon import DaemonProcess


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    """start_daemon(*flags) -> a started daemon; every daemon started is stopped after."""
    started: list[DaemonProcess] = []

    def start(*args: str, credentials=None, address_space_bytes=None) -> DaemonProcess:
        daemon = DaemonProcess(
            *args, credentials=credentials, address_space_bytes=address_space_bytes
        )
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One plain daemon (namespaces default, a, b with a 1 MiB quota) for a module's tests."""
    daemon = DaemonProcess(
        "--capacity", "64MiB", "--namespace", "default", "--namespace", "a",
        "--namespace", "b=1MiB", "--max-message-bytes", "1MiB",
    ).start()  # fmt: skip
    yield daemon
    daemon.stop()
