"""Exceptions of `hicache simulate`."""

from __future__ import annotations

from hicache.errors import HiCacheError


class SimulationError(HiCacheError):
    """A simulation that cannot run as configured (the message says what to change)."""


class TraceError(SimulationError, ValueError):
    """A trace file that cannot be read: names the file, the line and what was wrong."""
