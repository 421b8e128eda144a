"""Exceptions of the storage backends.

Expected outcomes (a miss, a corrupt page, a backend that is down once it has worked) are
return values and counters, never exceptions. These are for the surprises: a URL or option
that cannot work, a backend that was unreachable the first time it was used, misuse of the
API.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every exception raised by `storage_backends`."""


class BackendConfigError(StorageError, ValueError):
    """A backend URL or option is invalid (the message names the option and what is allowed)."""


class BackendUnavailableError(StorageError):
    """The backend could not be reached on its first use (wrong host, port, path, password).

    Raised once, so that a misconfigured L3 fails loudly at start-up. After a backend has
    worked once, an outage is a fault: calls return misses and count errors instead.
    """


class BackendClosedError(StorageError):
    """A call was made on a backend after `close()`."""
