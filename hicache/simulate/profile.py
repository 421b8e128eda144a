"""A hardware profile: what a running replica measured, for the simulator to use instead of
presets.

`hicache simulate --calibrate URL` asks a replica (`GET /v1/hicache/profile`, served by
`hicache engine serve`) for the rates its cache measured for the load-or-recompute choice
(`hicache.fetch_plan`): the compute fit of an engine step

    seconds = per_step_s + per_row_s * rows + per_pair_s * pairs

(`pairs`: the (row, attended position) pairs of the step's causal attention), the L2 -> L1
load rate, the L3 read rate and the L3 lookup round trip; what a request costs outside the
engine's steps (HTTP and the hand-over to the engine thread); plus the model the replica runs
(as the simulator's `ModelSpec` fields), its page size and bytes per page, its prefill
chunk, the device and the dtype. It writes them as one versioned JSON document;
`hicache simulate --profile FILE` reads it back and then:

- prefills a request's uncached tokens [start, end) as the engine does, in chunks of
  `prefill_chunk_tokens` rows, one step each, every step costing the fit above
  (`prefill_s`), instead of FLOPs / (peak x MFU);
- moves L1 <-> L2 pages at the measured load rate (the latency is inside that rate), and
  L3 pages at the measured read rate and round trip, instead of the link presets;
- sizes pages by the engine's own layout (`page_bytes`), so a tier of N pages is N pages;
- adds the request overhead to every TTFT (it occupies no GPU).

What the profile leaves out, and so the simulator too: decode steps batched with a
prefill, the replay of cached rows through a hybrid model's late layers, the router's hop
(the overhead is measured at the replica). `benchmarks/bench_planner.py` measures how far
that puts a plan from a live run. A rate the replica never measured (no L3 read yet) is the
cache's prior; the profile says how many samples stand behind each rate.

Torch-free (the simulator and the daemon must run without it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hicache.fetch_plan import ComputeFit, attention_pairs
from hicache.simulate.errors import SimulationError
from hicache.simulate.models import ModelSpec

PROFILE_FORMAT = "hicache-hardware-profile"
PROFILE_VERSION = 1
PROFILE_PATH = "/v1/hicache/profile"  # where a replica serves it


@dataclass(frozen=True)
class HardwareProfile:
    """One replica's measured costs (module docstring). Validated on construction."""

    model: ModelSpec
    device: str  # "cpu", or the GPU's name
    dtype: str  # the engine's compute and KV dtype
    page_size: int  # tokens per page
    page_bytes: int  # the engine's KV layout, per page
    prefill_chunk_tokens: int  # prompt rows one engine step takes at most
    max_running_requests: int
    compute: ComputeFit
    num_compute_samples: int
    l2_load_bytes_per_s: float
    num_load_samples: int
    l3_read_bytes_per_s: float
    num_read_samples: int
    l3_latency_s: float
    # A request's time outside the engine's steps, as a client sees it: HTTP, tokenizing,
    # handing it to the engine thread and the answer back (`calibrate`: the median, over
    # its warm-up prompts, of the wall time less the fitted step). Added to every TTFT.
    request_overhead_s: float = 0.0
    source: str = ""  # the URL it was measured at
    measured_at: str = ""  # ISO 8601, UTC

    def __post_init__(self) -> None:
        for name in ("page_size", "page_bytes", "prefill_chunk_tokens", "max_running_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_compute_samples", "num_load_samples", "num_read_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("l2_load_bytes_per_s", "l3_read_bytes_per_s"):
            value = getattr(self, name)
            if not _number(value) or not value > 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not _number(self.request_overhead_s) or self.request_overhead_s < 0:
            raise ValueError(
                f"request_overhead_s must be a finite number >= 0, got {self.request_overhead_s!r}"
            )
        if not _number(self.l3_latency_s) or self.l3_latency_s < 0:
            raise ValueError(
                f"l3_latency_s must be a finite number >= 0, got {self.l3_latency_s!r}"
            )
        for name in ("per_step_s", "per_row_s", "per_pair_s"):
            value = getattr(self.compute, name)
            if not _number(value) or value < 0:
                raise ValueError(f"compute.{name} must be a finite number >= 0, got {value!r}")
        if self.compute.per_row_s == 0 and self.compute.per_pair_s == 0:
            raise ValueError("compute: per_row_s and per_pair_s are both 0 (no cost per token)")
        if self.model.kv_bytes_per_token * self.page_size != self.page_bytes:
            raise ValueError(
                f"page_bytes {self.page_bytes} is not the model's KV bytes per token "
                f"({self.model.kv_bytes_per_token}) x page_size {self.page_size}"
            )

    # ------------------------------------------------------------------ the cost model

    def step_s(self, num_rows: int, num_pairs: int) -> float:
        return self.compute.seconds(num_rows, num_pairs)

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill prompt rows [start, end): one engine step per chunk of
        `prefill_chunk_tokens` rows, each row attending to every position before it."""
        total = 0.0
        chunk = self.prefill_chunk_tokens
        while start < end:
            stop = min(end, start + chunk)
            total += self.step_s(stop - start, attention_pairs(start, stop))
            start = stop
        return total

    # ------------------------------------------------------------------ the file

    def as_dict(self) -> dict[str, Any]:
        out = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "model":
                value = {k: v for k, v in asdict(value).items() if k != "draft"}
            elif field.name == "compute":
                value = asdict(value)
            out[field.name] = value
        return out

    def write(self, path: Path) -> None:
        try:
            path.write_text(json.dumps(self.as_dict(), indent=1) + "\n", encoding="utf-8")
        except OSError as error:
            raise SimulationError(f"{path}: cannot write: {error.strerror or error}") from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_MODEL_FIELDS = {field.name for field in fields(ModelSpec)} - {"draft"}


def profile_from_dict(data: Any, where: str) -> HardwareProfile:
    """A profile from its JSON document; a `SimulationError` naming `where` and the field
    when it is not one."""
    if not isinstance(data, dict):
        raise SimulationError(f"{where}: not a hardware profile (expected a JSON object)")
    if data.get("format") != PROFILE_FORMAT:
        raise SimulationError(
            f"{where}: not a hardware profile (format {data.get('format')!r}, "
            f"expected {PROFILE_FORMAT!r})"
        )
    if data.get("version") != PROFILE_VERSION:
        raise SimulationError(
            f"{where}: profile version {data.get('version')!r}; this hicache reads version "
            f"{PROFILE_VERSION} (calibrate again)"
        )
    names = {field.name for field in fields(HardwareProfile)}
    optional = ("source", "measured_at", "request_overhead_s")
    missing = sorted(n for n in names if n not in data and n not in optional)
    if missing:
        raise SimulationError(f"{where}: the profile has no {missing[0]!r}")
    unknown = sorted(set(data) - names - {"format", "version"})
    if unknown:
        raise SimulationError(f"{where}: unknown field {unknown[0]!r} in the profile")
    values = {n: data[n] for n in names if n in data}
    try:
        values["model"] = _model(data["model"])
        values["compute"] = _compute(data["compute"])
        return HardwareProfile(**values)
    except (TypeError, ValueError) as error:
        raise SimulationError(f"{where}: {error}") from None


def _model(data: Any) -> ModelSpec:
    if not isinstance(data, dict):
        raise ValueError("model must be an object of the simulator's model fields")
    unknown = sorted(set(data) - _MODEL_FIELDS)
    if unknown:
        raise ValueError(f"model: unknown field {unknown[0]!r}")
    return ModelSpec(**data)


def _compute(data: Any) -> ComputeFit:
    names = ("per_step_s", "per_row_s", "per_pair_s")
    if not isinstance(data, dict) or set(data) != set(names):
        raise ValueError(f"compute must be an object with exactly {', '.join(names)}")
    return ComputeFit(**{n: data[n] for n in names})


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile file; a one-line `SimulationError` naming the file when it is not one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SimulationError(f"--profile {path}: cannot read: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise SimulationError(f"--profile {path}: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SimulationError(
            f"--profile {path}: not valid JSON ({error.msg}, line {error.lineno})"
        ) from None
    return profile_from_dict(data, f"--profile {path}")
