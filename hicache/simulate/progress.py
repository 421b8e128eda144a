"""A progress bar on stderr for long runs: drawn only on a terminal, and only once a run has
taken longer than half a second, at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(
        self,
        label: str,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        delay_s: float = 0.5,
        width: int = 30,
    ) -> None:
        self.label = label
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._started = time.monotonic()
        self._delay_s = delay_s
        self._last_draw = 0.0
        self._width = width
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        self.update(done, total)

    def update(self, done: int, total: int) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        elapsed = now - self._started
        final = done >= total
        if elapsed < self._delay_s and not (final and self._drawn):
            return
        if not final and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        fraction = done / total if total else 1.0
        filled = int(fraction * self._width)
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\r{self.label} [{bar}] {done}/{total} {fraction:4.0%} {elapsed:5.1f}s")
        self._drawn = True
        if final:
            self._stream.write("\n")
            self._drawn = False
            self._enabled = False  # finished: nothing more to draw
        self._stream.flush()

    def close(self) -> None:
        """End the line if a bar was drawn and not finished."""
        if self._drawn and self._enabled:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False
