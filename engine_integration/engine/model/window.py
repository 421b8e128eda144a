"""The window layers' KV of one request: a ring of token slots per layer (late layers, or an
interleaved model's windowed source layers), at least W of them.

Position p lives in slot `p % slots`. Each layer keeps, per slot, the position it holds (or
none), so a reader can tell a slot's current token from an older one: a window read
returns the slots for a range of positions and a `valid` flag per position. The window
never leaves the engine: hicache holds only the source layers' KV and output, and a request
that hits the cache rebuilds its window by encoder replay (DESIGN.md) from that output.
An interleaved model's ring is larger than its window (`num_slots`): it keeps the positions
a sidecar of the cache takes at a page boundary (engine/sidecar.py), and a hit fills it from
one.
"""

from __future__ import annotations

import torch

_EMPTY = -1


class LateWindow:
    """`num_layers` rings of `num_slots` slots (default and at least `window_tokens`, the
    attention's window), each slot (2, num_kv_heads, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        window_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device,
        num_slots: int | None = None,
    ) -> None:
        self.window_tokens = window_tokens
        self.num_slots = max(window_tokens, num_slots or 0)
        slots = self.num_slots
        self.kv = torch.zeros(  # (layers, slots, 2, H, D); zeros, so unread slots stay finite
            (num_layers, slots, 2, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.positions = torch.full((num_layers, slots), _EMPTY, dtype=torch.long, device=device)
        # Per layer, one past the last position written (0: none), kept on the host so a
        # reader can tell without the device that the ring holds nothing it needs.
        self._written_end = [0] * num_layers

    def clear(self) -> None:
        """Forget every position (the KV stays, unread)."""
        self.positions.fill_(_EMPTY)
        self._written_end = [0] * len(self._written_end)

    def holds_from(self, layer: int, position: int) -> bool:
        """Whether layer `layer`'s ring may hold a position >= `position`."""
        return self._written_end[layer] > max(position, 0)

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of positions [start, end) as (end - start, 2, H, D), and which of them the
        ring holds now (positions < 0 or overwritten are invalid; their values are stale
        but finite)."""
        wanted = torch.arange(start, end, device=self.kv.device)
        slots = wanted.remainder(self.num_slots)
        kv = self.kv[layer].index_select(0, slots)
        valid = (self.positions[layer].index_select(0, slots) == wanted) & (wanted >= 0)
        return kv, valid

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store `kv[i]` (2, H, D) as position `start + i`; of more positions than slots
        only the last ones can stay."""
        end = start + kv.shape[0]
        self._written_end[layer] = max(self._written_end[layer], end)
        positions = torch.arange(start, end, device=self.kv.device)
        if positions.numel() > self.num_slots:
            positions = positions[-self.num_slots :]
            kv = kv[-self.num_slots :]
        slots = positions.remainder(self.num_slots)
        self.kv[layer].index_copy_(0, slots, kv)
        self.positions[layer].index_copy_(0, slots, positions)

    def held_positions(self, layer: int = 0) -> list[int]:
        """The positions layer `layer` holds, ascending."""
        held = self.positions[layer]
        return sorted(int(p) for p in held[held != _EMPTY].tolist())
