"""Sweeps: many configurations of one trace, run in parallel processes, and their table.

`parse_sweep("l2=0,256,1024")` gives the capacities of one axis (GB unless a unit is
given; also `start:stop:count`, linear, and `start..stop:count`, geometric). `grid` crosses
one or two axes over a base configuration. `run_configs` runs configurations in worker
processes (forked, so the trace is shared, not re-read) or in this one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hicache.simulate.config import SimulationConfig
from hicache.simulate.player import TracePlayer
from hicache.simulate.result import SimulationResult
from hicache.simulate.trace import Trace
from storage_backends.options import parse_size

SWEEP_TIERS = ("l1", "l2", "l3")


@dataclass(frozen=True)
class SweepAxis:
    tier: str  # l1, l2 or l3
    values_bytes: tuple[float, ...]

    @property
    def label(self) -> str:
        scope = "store" if self.tier == "l3" else "per instance"
        return f"{self.tier.upper()} GB ({scope})"


def parse_capacity(text: str) -> float:
    """Bytes from "512" (GB), "1.5TB", "800GiB"."""
    text = text.strip()
    try:
        return float(text) * 1e9
    except ValueError:
        return float(parse_size(text, name="capacity"))


def parse_sweep(spec: str) -> SweepAxis:
    tier, sep, values = spec.partition("=")
    tier = tier.strip().lower()
    if not sep or tier not in SWEEP_TIERS:
        raise ValueError(f"--sweep {spec!r}: expected l1=..., l2=... or l3=...")
    try:
        points = _sweep_values(values.strip())
    except ValueError as error:
        raise ValueError(f"--sweep {spec!r}: {error}") from None
    if not points or any(p < 0 for p in points):
        raise ValueError(f"--sweep {spec!r}: give one or more capacities >= 0")
    return SweepAxis(tier, tuple(points))


def _sweep_values(text: str) -> list[float]:
    if ":" in text:
        span, _, count_text = text.rpartition(":")
        count = int(count_text)
        if count < 2:
            raise ValueError("a range needs a count >= 2")
        if ".." in span:
            low, high = (parse_capacity(part) for part in span.split(".."))
            if low <= 0:
                raise ValueError("a geometric range starts above 0")
            return [float(v) for v in np.geomspace(low, high, count)]
        low, high = (parse_capacity(part) for part in span.split(":"))
        return [float(v) for v in np.linspace(low, high, count)]
    return [parse_capacity(part) for part in text.split(",") if part.strip()]


def grid(base: SimulationConfig, axes: Sequence[SweepAxis]) -> list[SimulationConfig]:
    """Every combination of the axes' capacities (the first axis varies slowest)."""
    if not 1 <= len(axes) <= 2:
        raise ValueError("a sweep has one or two axes")
    if len({axis.tier for axis in axes}) != len(axes):
        raise ValueError("sweep two different tiers")
    configs = [base]
    for axis in axes:
        configs = [
            config.replace(**{f"{axis.tier}_bytes": value})
            for config in configs
            for value in axis.values_bytes
        ]
    return configs


# ---------------------------------------------------------------------------- running

_worker_trace: Trace | None = None


def _run_one(config: SimulationConfig) -> SimulationResult:
    return TracePlayer(config, _worker_trace).run()


def _run_indexed(item: tuple[int, SimulationConfig]) -> tuple[int, SimulationResult]:
    return item[0], _run_one(item[1])


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the pool starts: its workers (forked by the pool's
    threads, which inherit the mask, also when they replace one) set their handlers before
    any reaches them; here they are delivered when the pool is up."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _worker_signals() -> None:
    """A worker leaves SIGINT to its parent and ends on SIGTERM (the pool's terminate)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def run_configs(
    configs: Sequence[SimulationConfig],
    trace: Trace,
    *,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[SimulationResult]:
    """Results in the order of `configs`. `jobs` processes (default: one per CPU)."""
    global _worker_trace
    jobs = min(len(configs), jobs or os.cpu_count() or 1)
    results: list[SimulationResult | None] = [None] * len(configs)
    _worker_trace = trace
    try:
        if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for i, config in enumerate(configs):
                results[i] = _run_one(config)
                if progress is not None:
                    progress(i + 1, len(configs))
            return results
        context = multiprocessing.get_context("fork")
        # Leaving the block terminates the workers: at once after a Ctrl-C or SIGTERM in
        # this process (the workers ignore both: the group's Ctrl-C is this process' to end).
        with _signals_blocked():
            pool = context.Pool(jobs, initializer=_worker_signals)
        with pool:
            runs = pool.imap_unordered(_run_indexed, enumerate(configs))
            for done, (i, result) in enumerate(runs, start=1):
                results[i] = result
                if progress is not None:
                    progress(done, len(configs))
        return results
    finally:
        _worker_trace = None
