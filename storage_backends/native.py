"""Which implementation the storage backends run on: the C extension `_pageio` (built from
`_pageio.c` where the install has a C compiler and the xxHash library's header), or without
it `portable`, the same checks and framing in Python.

`checks` is the one the object check and the framing go through (`xxh3_64`, `check_object`,
`check_copy`, `frame_headers`, `frame_copies`, the same answers from either): memory://,
redis:// and grpc:// work with or without the extension. The `file://` backend's batch reads
and writes are the extension's alone (they are why it exists: benchmarks/bench_file_read.py);
it asks for them with `require_pageio`, which names what to install where they are missing.
"""

from __future__ import annotations

from types import ModuleType

from . import portable
from .errors import BackendConfigError

try:
    from . import _pageio as pageio
except ImportError:  # an install without a C compiler: setup.py warned
    pageio = None

checks: ModuleType = pageio if pageio is not None else portable

_MISSING = (
    "{what} needs the C extension storage_backends._pageio, which this install lacks: install "
    "a C compiler, Python's headers and the xxHash header (Debian/Ubuntu: apt-get install gcc "
    "python3-dev libxxhash-dev), then reinstall (pip install -e .)"
)


def require_pageio(what: str) -> ModuleType:
    """The C extension, or BackendConfigError, one line naming `what` needs it and how to
    get it."""
    if pageio is None:
        raise BackendConfigError(_MISSING.format(what=what))
    return pageio


__all__ = ["checks", "pageio", "require_pageio"]
