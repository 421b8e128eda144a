"""Objects moved over plain loopback TCP the way Mooncake's TCP transport moves them, as a
control for bench_mooncake_sizes.py: is a cost that steps up with object size the kernel's
loopback, or the transport?

Each object is one request on the caller's connection, framed as that transport frames it:
a 17-byte request header (size, address, opcode), then for a write the body and an 8-byte
status frame back from the receiver, for a read an 8-byte status frame and then the body.
`op_bytes` is the most one send or one receive moves: None moves a body in as few system
calls as the kernel allows; 65,536 moves it as asio's composed reads and writes do (they
move at most `default_max_transfer_size`, 64 KiB, an operation), so a body 4 bytes past 64
KiB takes a second send and a second receive, each with its own wake-up. The figures are
Python's (a request costs tens of microseconds of interpreter), so only the ratios between
sizes under one mover say anything.
"""

from __future__ import annotations

import functools
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

_REQUEST = struct.Struct("<QQB")  # size, address, opcode: the transport's session header
_WRITE, _READ = 1, 0
_STATUS = (0x4D435456 << 32).to_bytes(8, "little")  # the transport's "done" frame
ASIO_OP_BYTES = 65536  # asio's default_max_transfer_size


def _send(sock: socket.socket, data: memoryview, op_bytes: int | None) -> None:
    step = op_bytes or len(data)
    for at in range(0, len(data), step):
        sock.sendall(data[at : at + step])


def _receive(sock: socket.socket, into: memoryview, op_bytes: int | None) -> bool:
    """Fill `into` with receives of at most `op_bytes`; False where the peer closed."""
    got = 0
    while got < len(into):
        want = len(into) - got if op_bytes is None else min(op_bytes, len(into) - got)
        n = sock.recv_into(into[got : got + want], want)
        if n == 0:
            return False
        got += n
    return True


def timed_at_once(
    pool: ThreadPoolExecutor, callers: int, steps: Sequence[Callable[[int], None]]
) -> tuple[float, ...]:
    """Seconds each step took, run by `callers` callers at once (`step(caller)` on `pool`),
    one step after another: a mover's puts, then its gets."""
    seconds = []
    for step in steps:
        began = time.perf_counter()
        list(pool.map(step, range(callers)))
        seconds.append(time.perf_counter() - began)
    return tuple(seconds)


def _connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


class LoopbackBatches:
    """`callers` loopback connections, each served by a thread of its own holding objects of
    up to `largest` bytes; `run` times one size's writes ("put"), then its reads ("get"), of
    `batches` calls of `batch` objects a caller, the same shape as the raw client's calls."""

    def __init__(
        self, callers: int, batch: int, batches: int, largest: int, op_bytes: int | None
    ) -> None:
        self.batch, self.batches, self.op_bytes = batch, batches, op_bytes
        self.body = memoryview(bytes(range(256)) * (-(-largest // 256)))[:largest]
        with socket.create_server(("127.0.0.1", 0)) as listener:
            pairs = [_connected_pair(listener) for _ in range(callers)]
        self.clients = [client for client, _ in pairs]
        self.servers = [
            threading.Thread(target=self._serve, args=(server, largest), daemon=True)
            for _, server in pairs
        ]
        for thread in self.servers:
            thread.start()
        self.pool = ThreadPoolExecutor(callers)

    def _serve(self, sock: socket.socket, largest: int) -> None:
        request = bytearray(_REQUEST.size)
        held = memoryview(bytearray(largest))
        with sock:
            while _receive(sock, memoryview(request), self.op_bytes):
                size, _, opcode = _REQUEST.unpack(request)
                if opcode == _WRITE:
                    if not _receive(sock, held[:size], self.op_bytes):
                        return
                    sock.sendall(_STATUS)
                else:
                    sock.sendall(_STATUS)
                    _send(sock, held[:size], self.op_bytes)

    def _calls(self, caller: int, size: int, opcode: int) -> None:
        sock, status = self.clients[caller], memoryview(bytearray(8))
        into = memoryview(bytearray(size))
        request = _REQUEST.pack(size, 0, opcode)
        for _ in range(self.batches * self.batch):
            sock.sendall(request)
            if opcode == _WRITE:
                _send(sock, self.body[:size], self.op_bytes)
                ok = _receive(sock, status, self.op_bytes)
            else:
                ok = _receive(sock, status, self.op_bytes)
                ok = ok and _receive(sock, into, self.op_bytes)
            if not ok or status.tobytes() != _STATUS:
                raise RuntimeError(f"loopback {'put' if opcode else 'get'} of {size} B failed")
        if opcode == _READ and into.tobytes() != self.body[:size].tobytes():
            raise RuntimeError(f"loopback get of {size} B read back other bytes than were put")

    def run(self, callers: int, size: int) -> tuple[float, float]:
        """Seconds for `callers` callers to write, then to read, their batches of `size`."""
        steps = [functools.partial(self._calls, size=size, opcode=op) for op in (_WRITE, _READ)]
        put_s, get_s = timed_at_once(self.pool, callers, steps)
        return put_s, get_s

    def close(self) -> None:
        self.pool.shutdown()
        for sock in self.clients:
            sock.close()  # each server thread sees the close and ends
        for thread in self.servers:
            thread.join(timeout=10)
