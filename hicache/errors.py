"""Exceptions of the hicache controller and its programs."""


class HiCacheError(Exception):
    """Misuse of the cache's API, or a state it cannot continue from (the message says)."""


class BackgroundTransferError(HiCacheError):
    """A background transfer failed; raised on the caller's next call. The pages it
    concerned were dropped from the cache, so nothing wrong was ever served."""
