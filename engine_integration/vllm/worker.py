"""The worker side of the vLLM connector: one step's loads and saves, layer by layer.

hicache's L1 is a small pool of staging pages on vLLM's device. A load is a hicache
`match` (L1 pages at once; L2 pages copied into fresh L1 pages by hicache's transfer
engine, layer by layer, on its copy stream; L3 pages prefetched into L2 first), and then,
in `wait_layer(i)`, layer i is copied from those L1 pages into the request's vLLM blocks
on the compute stream after waiting on layer i's copy event: layer i+1's copy over the
link overlaps layer i's attention. A save copies layer i of a request's full prompt pages
out of vLLM's blocks into fresh L1 pages right after layer i's attention wrote them
(`save_layer`), and at the end of the step hands the pages to hicache (`insert`), whose
write policy backs them up to L2 and L3 in the background. A final save (a finished
request's answer) copies every layer at the end of the step and reports the request as
sent, so vLLM frees the blocks it kept for it.

Every page a load could not deliver (evicted since the scheduler looked, or an L3 page
that failed verification: the match stops before it) is reported by block id, never
copied: vLLM recomputes from the first such block. An asynchronous load (plan.py) is done
whole in `start`, before the forward, and its request reported received (or failed:
`take_received`).

One `WorkerStep` serves one KV group (groups.py) with its own cache: a sliding-window
group matches and inserts only the window entry a hit of the request's length needs, and
copies only the positions its layers read; a save whose window blocks vLLM has already
released (null blocks) is skipped. A worker that does not write (`writes=False`: MLA's
ranks past the first, whose latent is rank 0's) only loads.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from engine_integration.vllm.groups import Extent, KVGroup, window_start
from engine_integration.vllm.kv import TokenSlots, VllmKV
from engine_integration.vllm.plan import LoadSpec, SaveSpec, StepPlan
from hicache.errors import HiCacheError
from tiers.errors import PoolExhaustedError

logger = logging.getLogger(__name__)

# vLLM's BlockPool takes its first block as the null block: what a sliding-window group's
# block table holds for blocks it released (vllm/v1/core/block_pool.py).
NULL_BLOCK_ID = 0


@dataclass
class _Load:
    spec: LoadSpec
    match: object  # hicache.controller.Match
    slots: TokenSlots
    layers_done: set[int] = field(default_factory=set)


@dataclass
class _Save:
    spec: SaveSpec
    extent: Extent
    page_ids: list[int]  # one L1 page per full page; the first `num_reused` are a match's
    num_reused: int
    slots: TokenSlots
    layers_done: set[int] = field(default_factory=set)


@dataclass
class WorkerCounters:
    loaded_tokens: int = 0
    failed_tokens: int = 0
    saved_pages: int = 0
    saves_skipped: int = 0


class WorkerStep:
    """Runs the plans of successive steps over one worker's registered KV."""

    def __init__(
        self,
        cache,
        kv: VllmKV,
        page_size: int,
        namespace_of,
        group: KVGroup,
        *,
        writes: bool = True,
    ) -> None:
        self.cache = cache
        self.group = group
        self.writes = writes
        self.namespace_of = namespace_of  # a spec's extra key -> this worker's namespace
        self.kv = kv
        self.page_size = page_size
        self.counters = WorkerCounters()
        self._loads: list[_Load] = []
        self._saves: list[_Save] | None = None
        self._plan: StepPlan | None = None
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # this step's: their blocks hold no KV there
        self._sent: set[str] = set()  # final saves done: their blocks may be freed
        self._received: set[str] = set()  # asynchronous loads done (or failed)
        self._failed_async: set[str] = set()

    # ------------------------------------------------------------------ loads

    def bind(self, plan: StepPlan) -> None:
        """The step's plan, before anything else of the step."""
        self._plan = plan

    def start(self) -> None:
        """Match every load of the step (hicache starts its L2 -> L1 copies)."""
        for spec in self._plan.loads if self._plan is not None else []:
            load = self._start_load(spec)
            if spec.is_async:
                self._received.add(spec.req_id)
                if spec.req_id in self._failed_requests:
                    self._failed_async.add(spec.req_id)
                if load is not None:
                    self._load_whole(load)

    def _start_load(self, spec: LoadSpec) -> _Load | None:
        end = len(spec.token_ids)
        extent = self.group.extent(spec.token_ids, spec.extra_key, self.page_size, end)
        try:
            match = self.cache.match(extent.token_ids, self.namespace_of(extent.extra_key))
        except HiCacheError as error:  # a background failure surfaces here: a miss
            logger.warning("hicache match failed, recomputing %s: %r", spec.req_id, error)
            self._fail(spec, spec.first_token)
            return None
        loaded = min(extent.origin + match.num_tokens, end)
        if loaded < end:  # a window is used whole or not at all
            self._fail(spec, max(loaded, spec.first_token) if not extent.origin else 0)
            if extent.origin:
                loaded = 0
        first = max(spec.first_token, self.group.first_read(end))
        if loaded <= first:
            self.cache.release(match)
            return None
        page_ids = [0] * (extent.origin // self.page_size) + match.device_page_ids  # see slots
        slots = self.kv.slots(
            spec.block_ids[self.group.index], page_ids, self.page_size, first, loaded
        )
        load = _Load(spec, match, slots)
        self._loads.append(load)
        self.counters.loaded_tokens += loaded - first
        return load

    def _load_whole(self, load: _Load) -> None:
        """An asynchronous load: every layer now, then the pages go back to hicache."""
        for layer in range(self.kv.num_layers):
            self.cache.wait_layer(load.match, layer)
            self.kv.copy_in(layer, self.cache.device_pool.kv[layer], load.slots)
        self._loads.remove(load)
        self.cache.release(load.match)

    def take_received(self) -> tuple[set[str], set[str]]:
        """(asynchronous loads done, those of them that failed) since the last call."""
        received, failed = self._received, self._failed_async
        self._received, self._failed_async = set(), set()
        return received, failed

    def _fail(self, spec: LoadSpec, first_failed_token: int) -> None:
        """Report the blocks holding tokens [first_failed_token, promised end)."""
        self._failed_requests.add(spec.req_id)
        block_size = self.kv.block_size
        first = first_failed_token // block_size
        last = -(-len(spec.token_ids) // block_size)
        self._failed_blocks.update(spec.block_ids[self.group.index][first:last])
        self.counters.failed_tokens += len(spec.token_ids) - first_failed_token

    def wait_layer(self, layer: int) -> None:
        """Layer `layer` of every load is in vLLM's blocks (in stream order on a GPU)."""
        l1 = self.cache.device_pool.kv[layer]
        for load in self._loads:
            if layer in load.layers_done:
                continue
            self.cache.wait_layer(load.match, layer)
            self.kv.copy_in(layer, l1, load.slots)
            load.layers_done.add(layer)

    # ------------------------------------------------------------------ saves

    def save_layer(self, layer: int) -> None:
        """Copy layer `layer` of every save of the step out of vLLM's blocks."""
        if self._saves is None:
            self._saves = self._prepare_saves()
        l1 = self.cache.device_pool.kv[layer]
        for save in self._saves:
            if layer not in save.layers_done:
                self.kv.copy_out(layer, l1, save.slots)
                save.layers_done.add(layer)

    def _prepare_saves(self, specs: list[SaveSpec] | None = None) -> list[_Save]:
        saves = []
        matches = {load.spec.req_id: load.match for load in self._loads}
        if specs is None:
            specs = self._plan.saves if self._plan is not None else []
        for spec in specs:
            if spec.req_id in self._failed_requests:
                self.counters.saves_skipped += 1  # vLLM recomputes it, and saves then
                continue
            match = matches.get(spec.req_id)
            save = self._prepare_save(spec, list(match.device_page_ids) if match else [])
            if save is not None:
                saves.append(save)
        return saves

    def _prepare_save(self, spec: SaveSpec, reused: list[int]) -> _Save | None:
        """L1 pages for a save: `reused` (a match's, already holding the first pages) and
        fresh ones for the rest; None when L1 has no room, when this worker does not write,
        or when vLLM has released a block the entry needs."""
        if not self.writes:
            return None
        block_ids = spec.block_ids[self.group.index]
        end = self._deepest_saved_end(block_ids, len(spec.token_ids))
        if end is None:
            self.counters.saves_skipped += 1  # released: outside the window vLLM kept
            return None
        extent = self.group.extent(spec.token_ids, spec.extra_key, self.page_size, end)
        num_pages = len(extent.token_ids) // self.page_size
        reused = reused[:num_pages] if not extent.origin else []
        try:
            fresh = self.cache.alloc_device_pages(num_pages - len(reused))
        except PoolExhaustedError:
            self.counters.saves_skipped += 1
            logger.info("hicache L1 is full: not saving %s", spec.req_id)
            return None
        page_ids = reused + fresh
        start = extent.origin + len(reused) * self.page_size
        padded = [0] * (extent.origin // self.page_size) + page_ids  # pages before: never read
        slots = self.kv.slots(block_ids, padded, self.page_size, start, end)
        return _Save(spec, extent, page_ids, len(reused), slots)

    def _deepest_saved_end(self, block_ids: list[int], end: int) -> int | None:
        """Where this group's entry for a save of `end` tokens ends: `end`, or for a
        sliding-window group whose blocks vLLM already released below the window (a
        finished request's: it keeps only the last token's window) the deepest page
        boundary whose window is still in blocks; None when there is none."""
        if self.group.kind != "sliding":
            return end
        block_size, page_size = self.kv.block_size, self.page_size
        while end > 0:
            start = window_start(end, self.group.window_tokens, page_size)
            if NULL_BLOCK_ID not in block_ids[start // block_size : -(-end // block_size)]:
                return end
            end -= page_size
        return None

    # ------------------------------------------------------------------ end of step

    def finish(self) -> None:
        """Complete the step: any layer not yet copied, the inserts, the releases."""
        for layer in range(self.kv.num_layers):
            self.wait_layer(layer)
        if self._plan is not None and self._plan.saves:
            for layer in range(self.kv.num_layers):
                self.save_layer(layer)  # layers the forward did not hand over
        for save in self._saves or []:
            self._insert(save)
        for spec in self._plan.final_saves if self._plan is not None else []:
            self._save_whole(spec)
            self._sent.add(spec.req_id)  # done or skipped: vLLM may free the blocks now
        for load in self._loads:
            self.cache.release(load.match)
        self._loads, self._saves, self._plan = [], None, None
        self._failed_requests = set()

    def _save_whole(self, spec: SaveSpec) -> None:
        """A finished request's pages, every layer at once (it has no forward pass left).
        On a GPU the copies are queued on the compute stream, before anything vLLM runs
        after this step in the blocks it frees."""
        save = self._prepare_save(spec, [])
        if save is None:
            return
        for layer in range(self.kv.num_layers):
            self.kv.copy_out(layer, self.cache.device_pool.kv[layer], save.slots)
        self._insert(save)

    def take_counters(self) -> dict[str, int]:
        """The counters since the last call, as a dict (then zeroed)."""
        counters, self.counters = self.counters, WorkerCounters()
        return dataclasses.asdict(counters)

    def take_finished_sending(self) -> set[str]:
        sent, self._sent = self._sent, set()
        return sent

    def _insert(self, save: _Save) -> None:
        try:
            namespace = self.namespace_of(save.extent.extra_key)
            new_pages = self.cache.insert(save.extent.token_ids, save.page_ids, namespace)
        except HiCacheError as error:
            logger.warning("hicache insert failed, not saving %s: %r", save.spec.req_id, error)
            self.cache.free_device_pages(save.page_ids[save.num_reused :])
            self.counters.saves_skipped += 1
            return
        self.counters.saved_pages += new_pages

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        """Release what a step left behind (a step cut short by an error)."""
        for load in self._loads:
            if not load.match.released:
                self.cache.release(load.match)
        for save in self._saves or []:
            self.cache.free_device_pages(save.page_ids[save.num_reused :])
        self._loads, self._saves = [], None
