"""Exceptions of the embedded engine."""

from __future__ import annotations


class EngineError(Exception):
    """Misuse of the engine, or a state it cannot continue from (the message says)."""


class CheckpointError(EngineError, ValueError):
    """A model directory that cannot be loaded: the message names every missing or
    mis-shaped tensor (or the file or field at fault)."""


class RequestTooLargeError(EngineError, ValueError):
    """A request needs more L1 pages than the pool can ever give it."""
