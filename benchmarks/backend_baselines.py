"""What each bench_backends.py case is timed against (`baselines_of`): the ceiling the issue
names, more baselines timed in turn with it, and references timed after, built from the
ceilings' ops (backend_ceilings.py). The runner (bench_backends.py) times them."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.backend_ceilings import (
    SGLANG_LAYER_BYTES,
    bare_pack_ops,
    memcpy_ops,
    per_file_ops,
    plain_redis_ops,
    raw_file_ops,
    raw_mooncake_ops,
    sglang_mooncake_ops,
)
from benchmarks.backend_workload import LAYOUT, Timed, Workload
from storage_backends.objects import header_size

Closer = Callable[[], Awaitable[None]]


@dataclass
class Baselines:
    """The ceiling's put and get; more baselines, each timed in turn with the ceiling
    (`more_puts`, `more_gets`: by label); references timed after them, a put and then a get
    (`references`); and what to close once the case is over."""

    put: Timed
    get: Timed
    more_puts: dict[str, Timed] = field(default_factory=dict)
    more_gets: dict[str, Timed] = field(default_factory=dict)
    references: dict[str, tuple[Timed, Timed]] = field(default_factory=dict)
    closers: list[Closer] = field(default_factory=list)

    def add(self, label: str, put: Timed, get: Timed, close: Closer) -> None:
        self.more_puts[f"{label}_put"] = put
        self.more_gets[f"{label}_get"] = get
        self.closers.append(close)

    async def close(self) -> None:
        for close in self.closers:
            await close()


def baselines_of(name: str, work: Workload, env: dict) -> Baselines:
    """The baselines of backend `name` (all but file_aiofiles, whose baseline is the file
    backend itself)."""
    if name == "memory":
        return Baselines(*memcpy_ops(work))
    if name in ("file", "file_fsync"):
        return _file_baselines(name, work, env["dir"])
    if name == "mooncake":
        return _mooncake_baselines(work, env)
    put, get, close = plain_redis_ops(env["redis_port"], work)
    return Baselines(put, get, closers=[close])


def _file_baselines(name: str, work: Workload, directory: Path) -> Baselines:
    """One large file written and read (with fsync at the end for `file_fsync`); more
    ceilings of the puts: for `file` the issue's own (one large file written with fsync), for
    `file_fsync` the cost of answering each batch durably without hicache (an fsync after
    each batch's bytes); and bare os calls as references."""
    base = Baselines(
        *raw_file_ops(directory, work, fsync="end" if name == "file_fsync" else "none")
    )
    if name == "file":
        base.more_puts["fsync_put"] = raw_file_ops(directory, work, fsync="end")[0]
    else:
        base.more_puts["batch_fsync_put"] = raw_file_ops(directory, work, fsync="batch")[0]
    base.references = {
        "per_file": per_file_ops(directory, work),
        "bare_pack": bare_pack_ops(directory, work),
    }
    return base


def _mooncake_baselines(work: Workload, env: dict) -> Baselines:
    """The raw client; as context, the raw client moving objects of a framed page's size,
    and (one batch at a time) the raw client called through a worker thread, as an asyncio
    caller must (with batches in flight, the raw client's calls are all made so); and
    SGLang's own Mooncake backend, where it runs."""
    address = env["mooncake"].address
    put, get, close = raw_mooncake_ops(address, work)
    base = Baselines(put, get, closers=[close])
    base.add("raw_framed", *raw_mooncake_ops(address, work, extra_bytes=header_size(LAYOUT)))
    if work.streams == 1:
        base.add("raw_threaded", *raw_mooncake_ops(address, work, threaded=True))
    if env.get("sglang") and work.page_bytes % SGLANG_LAYER_BYTES:
        print(f"not measuring SGLang's Mooncake backend at {work.page_bytes}-byte pages: its "
              f"MHA pages come in {SGLANG_LAYER_BYTES}-byte layers", file=sys.stderr)  # fmt: skip
    elif env.get("sglang"):
        base.add("sglang", *sglang_mooncake_ops(address, work))
    return base
