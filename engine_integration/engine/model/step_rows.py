"""A step's rows, as plain positions: `SeqRows` (one request's rows, the forward pass's
input, built by the scheduler), `HeldRows` (which positions a hidden tensor holds), and which
rows are read (`logits_runs`, `late_logits`). No torch op runs here; `forward.py` and its
mixins use them to pick rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine_integration.engine.model.window import LateWindow


@dataclass
class SeqRows:
    """One request's rows in a step: positions [start, end) of `token_ids`."""

    token_ids: Sequence[int]  # the tokens at positions start .. end - 1
    start: int
    end: int
    page_table: torch.Tensor  # (num_pages,) long: the request's L1 page ids, on the device
    window: LateWindow | None
    late_runs: list[tuple[int, int]] = field(default_factory=list)  # ascending, below end
    want_logits: bool = False
    wait_layer: Callable[[int], None] | None = None  # before reading layer i of the hit's pages

    @property
    def num_rows(self) -> int:
        return self.end - self.start


def logits_runs(seq: SeqRows) -> list[tuple[int, int]]:
    """The positions of `seq` whose output of a full-attention model's last layer is read:
    its last row when it wants logits. The other rows of the last layer only write their
    K/V."""
    return [(seq.end - 1, seq.end)] if seq.want_logits else []


class HeldRows:
    """The rows a hidden tensor holds: for each request of the step, runs of its positions
    (disjoint, ascending), one row per position, request after request."""

    def __init__(self, runs: list[list[tuple[int, int]]]) -> None:
        self.runs = runs
        self._firsts: list[list[tuple[int, int, int]]] = []  # (start, end, row of start)
        row = 0
        for seq_runs in runs:
            self._firsts.append([])
            for start, end in seq_runs:
                self._firsts[-1].append((start, end, row))
                row += end - start

    def rows(self, k: int, start: int, end: int) -> range:
        """The rows of request k's positions [start, end), which lie in one run."""
        for run_start, run_end, row in self._firsts[k]:
            if run_start <= start and end <= run_end:
                return range(row + start - run_start, row + end - run_start)
        raise ValueError(f"positions [{start}, {end}) of request {k} are not held")

    def logit_rows(self, seqs: Sequence[SeqRows]) -> list[int]:
        """The row of the last position of each request that wants logits."""
        return [self.rows(k, s.end - 1, s.end)[0] for k, s in enumerate(seqs) if s.want_logits]

    def step_rows(self, seqs: Sequence[SeqRows]) -> list[int]:
        """Where the held positions are among the step's rows (every row of each request)."""
        rows, base = [], 0
        for seq, seq_runs in zip(seqs, self.runs, strict=True):
            rows.extend(base + p - seq.start for start, end in seq_runs for p in range(start, end))
            base += seq.num_rows
        return rows


def consecutive(rows: list[int]) -> bool:
    """Whether `rows` are n, n + 1, ... in order (an empty list is not)."""
    return bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))


def late_logits(seqs: Sequence[SeqRows], runs) -> list[tuple[int, int, int]]:
    """For late `runs` (k, seq, start, end) of `seqs`, the late rows that want logits:
    (row among the late rows, row among the logits rows, position)."""
    logits_row = {k: n for n, k in enumerate(k for k, s in enumerate(seqs) if s.want_logits)}
    wanted, offset = [], 0
    for k, seq, start, end in runs:
        last = seq.end - 1
        if seq.want_logits and start <= last < end:
            wanted.append((offset + last - start, logits_row[k], last))
        offset += end - start
    return wanted
