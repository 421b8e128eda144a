"""The C fast paths of the storage backends (page framing, the file backend's reads and
writes), where this install has them.

`pageio` is the `_pageio` extension (built from `_pageio.c` when the project is installed) or
None where it could not be built (no C compiler, not Linux). Every user of it has a Python
path doing the same work, so an install without it loses speed, never function or safety:
the extension only ever answers "this page checked out" or "look closer", and the Python
readers name what is wrong.
"""

from __future__ import annotations

try:
    from . import _pageio as pageio
except ImportError:  # not built here: the Python paths
    pageio = None

__all__ = ["pageio"]
