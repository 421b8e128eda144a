"""The shape of an interleaved model's sidecars, without torch: how many pages each takes and
under which keys the index holds them (engine/sidecar.py moves their KV).

A sidecar of page boundary b is a run of pages chained on from b's page key, its tokens all
`TAG_TOKEN` (a whole sidecar) or `TAG_TOKEN - k` (a delta of k pages, whole together with
the whole sidecar k pages up). `SidecarShape.whole_runs` is the one rule of when a boundary's
sidecar is whole: the engine follows it loading a hit's sidecar (`pages.CachedPages`), and
the router checking its replicas' indexes (`SidecarKeys`, serve/route_index.py), so that
the prefix the router counts is the hit a replica serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine_integration.engine.model.config import ModelConfig
from radix.keys import TOKEN_BYTES, chain_keys

TAG_TOKEN = 0xFFFF_FFFF  # a whole sidecar's; TAG_TOKEN - k: a delta of k pages
_MAX_FIELD = 1 << 16  # a stated shape's layers or pages (far past any model's)


@dataclass(frozen=True)
class SidecarShape:
    """How the sidecars of one model and page size are laid out."""

    page_size: int
    num_windowed_layers: int
    num_page_layers: int
    span_pages: int  # pages of windowed KV a sidecar holds (fewer near the start)

    @classmethod
    def of(cls, config: ModelConfig, page_size: int) -> SidecarShape | None:
        """None for a model without windowed source layers."""
        if not config.windowed_layers:
            return None
        return cls(
            page_size=page_size,
            num_windowed_layers=len(config.windowed_layers),
            num_page_layers=config.num_page_layers,
            span_pages=-(-(config.window_tokens - 1) // page_size),
        )

    @property
    def ring_slots(self) -> int:
        """Ring slots a request needs so that a sidecar of its last full page can still be
        read off the ring (one page more than a sidecar's span)."""
        return (self.span_pages + 1) * self.page_size

    def tag_page(self, delta_pages: int = 0) -> list[int]:
        """The first page of a sidecar's run in the index: a whole sidecar's, or a delta's of
        `delta_pages` pages."""
        return [TAG_TOKEN - delta_pages] * self.page_size

    def tag_pages(self) -> list[list[int]]:
        """The first page of every kind of sidecar run (whole, then each delta)."""
        return [self.tag_page(k) for k in range(self.span_pages)]

    def pages_before(self, boundary: int) -> int:
        """Pages of windowed KV the whole sidecar of `boundary` holds."""
        return min(self.span_pages, boundary // self.page_size)

    def window_pages(self, boundary: int, delta_pages: int = 0) -> int:
        """Pages of windowed KV the sidecar of `boundary` holds: whole, or a delta's."""
        return delta_pages or self.pages_before(boundary)

    def num_pages(self, boundary: int, delta_pages: int = 0) -> int:
        """Cache pages the sidecar of `boundary` takes (whole, or a delta)."""
        pieces = self.num_windowed_layers * self.window_pages(boundary, delta_pages)
        return -(-pieces // self.num_page_layers)

    def tokens(self, tokens: bytes, boundary: int, delta_pages: int = 0) -> bytes:
        """The index tokens of the sidecar of `boundary` of `tokens` (encoded): the prefix,
        then the tag pages (a whole sidecar's, or a delta's)."""
        return tokens[: boundary * TOKEN_BYTES] + self.tag_tokens(boundary, delta_pages)

    def tag_tokens(self, boundary: int, delta_pages: int = 0) -> bytes:
        """The tokens (encoded) of the run of pages the sidecar of `boundary` takes."""
        tag = (TAG_TOKEN - delta_pages).to_bytes(TOKEN_BYTES, "little")
        return tag * (self.num_pages(boundary, delta_pages) * self.page_size)

    def whole_runs(self, boundary: int, has: Callable[[int, int], bool]) -> int:
        """The runs (1 or 2) that make the sidecar of `boundary` whole, asking `has(boundary,
        delta_pages)` of each run in turn (the engine loads a run as it asks): a whole
        sidecar, else the first delta of k pages found and the whole sidecar k pages up;
        0 where neither is all there."""
        for delta_pages in range(min(self.span_pages, boundary // self.page_size)):
            if not has(boundary, delta_pages):
                continue
            if not delta_pages:
                return 1
            base = boundary - delta_pages * self.page_size
            return 2 if has(base, 0) else 0
        return 0

    def to_info(self) -> dict[str, int]:
        """The shape as a replica's /hicache/info states it (`from_info` reads it back)."""
        return {
            "num_windowed_layers": self.num_windowed_layers,
            "num_page_layers": self.num_page_layers,
            "span_pages": self.span_pages,
        }

    @classmethod
    def from_info(cls, info: object, page_size: int) -> SidecarShape:
        """The shape a replica states; ValueError naming a field missing or out of range."""
        if not isinstance(info, dict):
            raise ValueError(f"sidecar: expected an object, got {type(info).__name__}")
        if type(page_size) is not int or not 1 <= page_size <= _MAX_FIELD:
            raise ValueError(f"sidecar: a page size in [1, {_MAX_FIELD}], not {page_size!r}")
        fields = {}
        for name in ("num_windowed_layers", "num_page_layers", "span_pages"):
            value = info.get(name)
            if type(value) is not int or not 1 <= value <= _MAX_FIELD:
                raise ValueError(f"sidecar.{name}: expected an int in [1, {_MAX_FIELD}]")
            fields[name] = value
        return cls(page_size=page_size, **fields)


class SidecarKeys:
    """The keys of the sidecars one prompt's pages may have in an index, made as they are
    asked for and kept: one prompt is weighed on every replica, which hold different keys.

    `keys` are the prompt's page keys. A boundary's runs chain on from its page key, so the
    first page of a run is hashed alone first: a boundary without a sidecar costs one hash a
    kind of run, not a whole run's.
    """

    def __init__(self, shape: SidecarShape, keys: list[bytes]) -> None:
        self.shape = shape
        self.keys = keys
        self._runs: dict[tuple[int, int], list[bytes]] = {}

    def run(self, boundary: int, delta_pages: int, num_pages: int | None = None) -> list[bytes]:
        """The keys of the run of the sidecar of `boundary` (a whole one, or a delta), or of
        its first `num_pages` pages."""
        made = self._runs.get((boundary, delta_pages), [])
        wanted = self.shape.num_pages(boundary, delta_pages)
        want = wanted if num_pages is None else min(num_pages, wanted)
        if len(made) < want:
            size = self.shape.page_size
            tag = self.shape.tag_tokens(boundary, delta_pages)
            made = chain_keys(self.keys[boundary // size - 1], tag, size, want)
            self._runs[(boundary, delta_pages)] = made
        return made[:want]

    def served_pages(self, num_pages: int, held: Callable[[bytes], bool]) -> int:
        """How many of the first `num_pages` pages a hit is served: the deepest boundary
        whose sidecar `held` (every page of its runs in some tier) makes whole."""
        size = self.shape.page_size

        def has(boundary: int, delta_pages: int) -> bool:
            return held(self.run(boundary, delta_pages, 1)[0]) and all(
                map(held, self.run(boundary, delta_pages))
            )

        for depth in range(min(num_pages, len(self.keys)), 0, -1):
            if self.shape.whole_runs(depth * size, has):
                return depth
        return 0
