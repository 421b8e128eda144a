"""What the daemon raises where a request is refused: it becomes the call's status."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request this server refuses, with the gRPC status code it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
