"""The scheduler side of the vLLM connector: how many tokens hicache can supply, and the
per-step plan (loads and saves) it hands to the worker.

- `num_new_matched_tokens`: hicache's index, plus one batched L3 `exists` for the pages
  past it (`HiCache.prefetch`, which also starts fetching those pages into L2 so they are
  there when the worker loads). The answer is whole hicache pages, of the prompt minus its
  last token (vLLM must compute at least one), capped by the L1 staging pages left this
  step. Loads are synchronous in vLLM's sense: they run inside the step's forward pass,
  layer by layer, so the second value is always False.
- `after_alloc` records the load against the blocks vLLM gave the request.
- `build_metadata`: the step's loads, and a save for every request whose prompt is fully
  computed by this step (its full pages, from vLLM's blocks, during this forward).
- `finished`: nothing to keep. The save copies the blocks into hicache's L1 while the
  step runs (then L1 -> L2 -> L3 in the background, in hicache's own pages), so vLLM may
  free the blocks when the request ends.

Only prompt pages are saved: a multi-turn conversation's next prompt hits the previous
prompt, and its answer is saved as part of the next prompt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine_integration.vllm_setup import SharedCache, namespace_for
from radix.keys import Namespace

logger = logging.getLogger(__name__)

# After an L3 lookup runs into its timeout, lookups skip L3 this long: a hung store must not
# hold every new request of vLLM's scheduler loop for the timeout.
L3_QUIET_S = 5.0


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens [first_token, num_tokens) of a request into its vLLM blocks."""

    req_id: str
    token_ids: list[int]  # the prefix to match: num_tokens tokens, whole pages
    namespace: Namespace
    first_token: int  # vLLM's own prefix hit ends here
    block_ids: list[int]  # the request's blocks, from token 0


@dataclass(frozen=True)
class SaveSpec:
    """Save a request's full prompt pages from its vLLM blocks."""

    req_id: str
    token_ids: list[int]  # whole pages
    namespace: Namespace
    block_ids: list[int]


@dataclass
class Lookup:
    """What one `num_new_matched_tokens` answer was based on."""

    first_token: int
    num_tokens: int  # hicache's hit, in tokens
    tiers: tuple[int, int, int]  # pages from L1, L2, L3


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    namespace: Namespace
    saved: bool = False


@dataclass
class StepPlan:
    """The scheduler's plan for one step (the connector metadata's payload)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class SchedulerPlanner:
    """Scheduler-side state of the connector. `shared` is the engine's cache (None until
    the worker has registered its KV, and then every lookup is a miss)."""

    def __init__(self, block_size: int, *, rank: int = 0, world_size: int = 1) -> None:
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.shared: SharedCache | None = None
        self._lookups: dict[str, Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._loading: dict[str, set[int]] = {}  # the last step's loads: req id -> blocks
        self._promised_pages = 0
        self._l3_quiet_until = 0.0

    def namespace(self, request) -> Namespace:
        shared = self.shared
        lora = getattr(request, "lora_request", None)
        return namespace_for(
            shared.model_id,
            shared.layout,
            rank=self.rank,
            world_size=self.world_size,
            cache_salt=getattr(request, "cache_salt", None),
            lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        )

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.shared is None:
            return 0, False
        cache, page_size = self.shared.cache, self.shared.layout.page_size
        tokens = list(request.all_token_ids[: request.num_tokens - 1])
        namespace = self.namespace(request)
        use_l3 = time.monotonic() >= self._l3_quiet_until
        if use_l3:
            self._look_up_l3(tokens, namespace)
        found = cache.cached_prefix(tokens, namespace)
        num_pages = found.num_l1_pages + found.num_l2_pages
        if use_l3:
            num_pages += found.num_l3_pages
        budget = cache.config.l1.num_pages - self._promised_pages
        num_pages = max(0, min(num_pages, budget))
        num_tokens = num_pages * page_size
        self._lookups[request.request_id] = Lookup(
            num_computed_tokens,
            num_tokens,
            (found.num_l1_pages, found.num_l2_pages, found.num_l3_pages),
        )
        return max(0, num_tokens - num_computed_tokens), False

    def _look_up_l3(self, tokens: list[int], namespace: Namespace) -> None:
        """The one batched L3 lookup past the index; it also starts fetching what it finds
        into L2. A lookup that failed or ran into its timeout makes the next L3_QUIET_S skip
        L3 (a failure is an L3 error or timeout counted meanwhile)."""
        cache = self.shared.cache
        errors = _l3_errors(cache)
        start = time.monotonic()
        cache.prefetch(tokens, namespace)
        slow = time.monotonic() - start >= cache.config.l3.exists_timeout_s
        if slow or _l3_errors(cache) > errors:
            self._l3_quiet_until = time.monotonic() + L3_QUIET_S
            logger.warning(
                "hicache L3 lookup failed: lookups skip L3 for the next %.0f s", L3_QUIET_S
            )

    def lookup(self, req_id: str) -> Lookup | None:
        return self._lookups.get(req_id)

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if self.shared is None:
            return
        req_id = request.request_id
        namespace = self.namespace(request)
        self._tracked.setdefault(req_id, _Tracked(request, namespace))
        lookup = self._lookups.get(req_id)
        if not num_external_tokens or lookup is None:
            return
        end = lookup.first_token + num_external_tokens
        page_size = self.shared.layout.page_size
        self._promised_pages += -(-end // page_size)
        self._loads.append(
            LoadSpec(
                req_id=req_id,
                token_ids=list(request.all_token_ids[:end]),
                namespace=namespace,
                first_token=lookup.first_token,
                block_ids=list(block_ids),
            )
        )

    def build_metadata(self, scheduler_output, block_ids_of) -> StepPlan:
        """The step's plan; `block_ids_of(req_id)` gives a request's blocks (group 0)."""
        plan = StepPlan(loads=self._loads)
        self._loading = {load.req_id: set(load.block_ids) for load in self._loads}
        self._loads = []
        self._promised_pages = 0
        if self.shared is None:
            return plan
        page_size = self.shared.layout.page_size
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.saved:
                continue
            request = tracked.request
            if request.num_computed_tokens + num_new < request.num_prompt_tokens:
                continue  # a prefill chunk: the prompt is not complete yet
            tracked.saved = True
            num_tokens = request.num_prompt_tokens // page_size * page_size
            lookup = self._lookups.pop(req_id, None)
            if not num_tokens or (lookup is not None and lookup.num_tokens >= num_tokens):
                continue  # no full page, or hicache holds them all already
            num_blocks = -(-num_tokens // self.block_size)
            plan.saves.append(
                SaveSpec(
                    req_id=req_id,
                    token_ids=list(request.prompt_token_ids[:num_tokens]),
                    namespace=tracked.namespace,
                    block_ids=list(block_ids_of(req_id)[:num_blocks]),
                )
            )
        return plan

    def load_errors(self, invalid_block_ids: set[int]) -> None:
        """The worker could not load these blocks: vLLM recomputes those requests, and
        their prompts are saved again once computed (which also repairs a corrupt L3
        page, overwritten by the new copy)."""
        for req_id, blocks in self._loading.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None and blocks & invalid_block_ids:
                tracked.saved = False
                self._lookups.pop(req_id, None)

    def finished(self, request) -> tuple[bool, dict | None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None


def _l3_errors(cache) -> int:
    stats = cache.executor.l3_stats()
    return stats.num_errors + stats.num_timeouts if stats is not None else 0
