"""Shared test set-up.

Triton kernels run on the CPU through the interpreter; the variable must be set before
triton is first imported, so it is set here, at collection time, on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.servers import MooncakeHolder, MooncakeMaster

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A `mooncake_master` and one `mooncake_client` lending it 256 MiB, on loopback ports;
    the backends under test lend nothing (segment=0), as an engine's client would."""
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    holder = None
    try:
        holder = MooncakeHolder(master, 256 << 20).start()
        yield master
    finally:
        if holder is not None:
            holder.stop()
        master.stop()
