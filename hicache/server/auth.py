"""Bearer-token check of the daemon's calls.

The token is read once from `--auth-token-file` (surrounding whitespace dropped). A call must
carry `authorization: Bearer <token>` metadata; the comparison is constant-time
(`hmac.compare_digest`), so timing reveals nothing about the token. The health service is
not checked: load balancers and orchestrators probe it without credentials, and it says
nothing but "serving".
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Iterable

from storage_backends.protocol import AUTH_METADATA_KEY, BEARER_PREFIX

logger = logging.getLogger(__name__)


class TokenCheck:
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token is empty")
        self._expected = token.encode()

    @classmethod
    def from_file(cls, path: str) -> TokenCheck:
        try:
            with open(path, "rb") as f:
                token = f.read().decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--auth-token-file: cannot read {path}: {exc}") from None
        if not token:
            raise ValueError(f"--auth-token-file: {path} is empty")
        if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s: the auth token file is readable by other users", path)
        return cls(token)

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the metadata carries the token; else why the call is refused."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA_KEY]
        if not values:
            return (
                f"missing bearer token: this server needs '{AUTH_METADATA_KEY}: "
                f"{BEARER_PREFIX}<token>' metadata (grpc:// URL option token_file)"
            )
        presented = values[-1]
        if isinstance(presented, str):
            presented = presented.encode()
        prefix = BEARER_PREFIX.encode()
        if not presented.startswith(prefix):
            return f"the {AUTH_METADATA_KEY} metadata is not '{BEARER_PREFIX}<token>'"
        if not hmac.compare_digest(presented[len(prefix) :], self._expected):
            return "wrong bearer token"
        return None
