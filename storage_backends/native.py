"""The C extension of the storage backends, `_pageio` (built from `_pageio.c` when the
project is installed): the page checksum (XXH3), the check of a stored object, the framing
of pages and the file backend's batch reads and writes. It is the only implementation of
each, so it is required: an install that cannot build it fails (setup.py says why), and an
import without it fails here, saying how to build it.
"""

from __future__ import annotations

try:
    from . import _pageio as pageio
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "storage_backends._pageio (the C extension every page checksum, check, read and "
        "write goes through) is not built in this install: reinstall the project with a C "
        "compiler and Python's headers present (pip install -e .), or build it in place with "
        "`python setup.py build_ext --inplace`"
    ) from exc

__all__ = ["pageio"]
