"""The late layers' KV of one request: a ring of W token slots per late layer.

Position p lives in slot `p % W`. Each layer keeps, per slot, the position it holds (or
none), so a reader can tell a slot's current token from an older one: a window read
returns the slots for a range of positions and a `valid` flag per position. The window
never leaves the engine: hicache holds only the source layers' KV and output, and a request
that hits the cache rebuilds its window by encoder replay (DESIGN.md) from that output.
"""

from __future__ import annotations

import torch

_EMPTY = -1


class LateWindow:
    """`num_layers` rings of `window_tokens` slots, each slot (2, num_kv_heads, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        window_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device,
    ) -> None:
        self.window_tokens = window_tokens
        self.kv = torch.zeros(  # (layers, W, 2, H, D); zeros, so unread slots stay finite
            (num_layers, window_tokens, 2, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.positions = torch.full(
            (num_layers, window_tokens), _EMPTY, dtype=torch.long, device=device
        )
        # Per layer, one past the last position written (0: none), kept on the host so a
        # reader can tell without the device that the ring holds nothing it needs.
        self._written_end = [0] * num_layers

    def holds_from(self, layer: int, position: int) -> bool:
        """Whether layer `layer`'s ring may hold a position >= `position`."""
        return self._written_end[layer] > max(position, 0)

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of positions [start, end) as (end - start, 2, H, D), and which of them the
        ring holds now (positions < 0 or overwritten are invalid; their values are stale
        but finite)."""
        wanted = torch.arange(start, end, device=self.kv.device)
        slots = wanted.remainder(self.window_tokens)
        kv = self.kv[layer].index_select(0, slots)
        valid = (self.positions[layer].index_select(0, slots) == wanted) & (wanted >= 0)
        return kv, valid

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store `kv[i]` (2, H, D) as position `start + i`; of more than W positions only the
        last W can stay."""
        end = start + kv.shape[0]
        self._written_end[layer] = max(self._written_end[layer], end)
        positions = torch.arange(start, end, device=self.kv.device)
        if positions.numel() > self.window_tokens:
            positions = positions[-self.window_tokens :]
            kv = kv[-self.window_tokens :]
        slots = positions.remainder(self.window_tokens)
        self.kv[layer].index_copy_(0, slots, kv)
        self.positions[layer].index_copy_(0, slots, positions)

    def held_positions(self, layer: int = 0) -> list[int]:
        """The positions layer `layer` holds, ascending."""
        held = self.positions[layer]
        return sorted(int(p) for p in held[held != _EMPTY].tolist())
