"""The scheduler side of the vLLM connector: how many tokens hicache can supply, and the
per-step plan (loads and saves) it hands to the worker.

- `num_new_matched_tokens`: what the workers' caches hold of the prompt minus its last
  token (vLLM must compute at least one), through `engine_integration.vllm.lookup` (the
  index, and one batched L3 `exists` past it, which also starts fetching those pages into
  L2 for the load). The answer is whole hicache pages, capped by the L1 staging pages left
  this step. A synchronous load (the default for a model of one KV group) runs inside the
  step's forward pass, layer by layer; an asynchronous one (`load_async`, always for several
  groups: vLLM recovers their failed loads only through `failed_recving`) runs whole before
  the forward of the step that carries it, and the request waits in
  WAITING_FOR_REMOTE_KVS until the worker reports it received. With asynchronous loads the
  lookup itself runs on a thread of the planner: the scheduler waits for it at most
  `LOOKUP_WAIT_S` (enough for an index-only answer), and otherwise gets None ("ask again
  next step"), so an L3 `exists` never holds vLLM's scheduler loop. vLLM asks again for a
  request at every step it stays waiting (no blocks for it yet, or its lookup running):
  only once the request's last L3 lookup is `ask_again_s` old (`L3Config.ask_again_s`) is
  L3 asked again; until then the workers answer from their indexes, which hold what L3 had.
- `after_alloc` records the load against the blocks vLLM gave the request.
- `build_metadata`: the step's loads, and a save for every request whose prompt is fully
  computed by this step (its full pages, from vLLM's blocks, during this forward).
- `finished`: a request that ended with full pages past its prompt (its answer) has them
  saved in the next step (`final_saves`), whole, and vLLM keeps its blocks until the worker
  reports the copy done (`get_finished`): a multi-turn conversation's next prompt then hits
  the previous answer too. Otherwise nothing is kept: a save copies the blocks into
  hicache's L1 during the step (then L1 -> L2 -> L3 in the background, in hicache's own
  pages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from engine_integration.vllm.config import request_extra_key
from engine_integration.vllm.lookup import Found
from hicache.match import ask_l3_again

logger = logging.getLogger(__name__)

LOOKUP_WAIT_S = 0.002  # how long the scheduler waits for an asynchronous lookup


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens [first_token, len(token_ids)) of a request into its vLLM blocks."""

    req_id: str
    token_ids: list[int]  # the prefix to match: whole pages
    extra_key: str  # the request's part of the namespace (each worker adds its rank)
    first_token: int  # vLLM's own prefix hit ends here
    block_ids: tuple[list[int], ...]  # the request's blocks per KV group, from token 0
    is_async: bool = False  # loaded whole before the forward, reported as received


@dataclass(frozen=True)
class SaveSpec:
    """Save a request's full prompt pages from its vLLM blocks."""

    req_id: str
    token_ids: list[int]  # whole pages
    extra_key: str
    block_ids: tuple[list[int], ...]  # per KV group


@dataclass
class Lookup:
    """What one `num_new_matched_tokens` answer was based on."""

    first_token: int
    num_tokens: int  # the caches' hit, in tokens
    found: Found


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    extra_key: str
    saved: bool = False


@dataclass
class StepPlan:
    """The scheduler's plan for one step (the connector metadata's payload)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests that ended with full pages past their prompt: saved whole at the end of the
    # step (their blocks wait for it), then reported as finished sending.
    final_saves: list[SaveSpec] = field(default_factory=list)


# (tokens, extra key, whether to ask L3 past the indexes) -> what the caches hold
Finder = Callable[[list[int], str, bool], Found]


class SchedulerPlanner:
    """Scheduler-side state of the connector, over `find` (the workers' caches)."""

    def __init__(
        self,
        find: Finder,
        page_size: int,
        block_size: int,
        l1_pages: int,
        load_async: bool = False,
        *,
        ask_again_s: float,  # `L3Config.ask_again_s`
    ) -> None:
        self.find = find
        self.ask_again_s = ask_again_s
        self.load_async = load_async
        self.page_size = page_size
        self.block_size = block_size
        self.l1_pages = l1_pages
        self._lookups: dict[str, Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._loading: dict[str, set[int]] = {}  # the last step's loads: req id -> blocks
        self._final_saves: list[SaveSpec] = []
        self.sending: set[str] = set()  # finished requests whose blocks wait for a save
        self._promised_pages = 0
        self._finding: dict[str, Future] = {}
        self._asked: dict[str, float] = {}  # req id -> when L3 was last asked about it
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="hicache-lookup") if load_async else None
        )

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens hicache adds to vLLM's own hit, whether loaded asynchronously); None
        while an asynchronous lookup is still running."""
        found = self._find(request)
        if found is None:
            return None, False
        budget = self.l1_pages - self._promised_pages
        num_tokens = max(0, min(found.num_pages, budget)) * self.page_size
        self._lookups[request.request_id] = Lookup(num_computed_tokens, num_tokens, found)
        num_new = max(0, num_tokens - num_computed_tokens)
        return num_new, self.load_async and num_new > 0

    def _find(self, request) -> Found | None:
        tokens = list(request.all_token_ids[: request.num_tokens - 1])
        extra_key = request_extra_key(request)
        if self._pool is None:
            return self.find(tokens, extra_key, self._ask_l3(request.request_id))
        future = self._finding.get(request.request_id)
        if future is None:
            ask_l3 = self._ask_l3(request.request_id)
            future = self._pool.submit(self.find, tokens, extra_key, ask_l3)
            self._finding[request.request_id] = future
        try:
            found = future.result(timeout=LOOKUP_WAIT_S)
        except FutureTimeout:
            return None
        except Exception as error:  # a failed lookup is a miss
            logger.warning("hicache lookup failed: %r", error)
            found = Found(0, 0, 0)
        del self._finding[request.request_id]
        return found

    def _ask_l3(self, req_id: str) -> bool:
        """Whether this lookup asks L3 past the indexes: once the request's last one that
        did is `ask_again_s` old (vLLM asks about a waiting request every step)."""
        now = time.monotonic()
        if not ask_l3_again(self._asked.get(req_id), now, self.ask_again_s):
            return False
        self._asked[req_id] = now
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def lookup(self, req_id: str) -> Lookup | None:
        return self._lookups.get(req_id)

    def after_alloc(
        self, request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request, request_extra_key(request)))
        lookup = self._lookups.get(req_id)
        if not num_external_tokens or lookup is None:
            return
        end = lookup.first_token + num_external_tokens
        self._promised_pages += -(-end // self.page_size)
        self._loads.append(
            LoadSpec(
                req_id=req_id,
                token_ids=list(request.all_token_ids[:end]),
                extra_key=self._tracked[req_id].extra_key,
                first_token=lookup.first_token,
                block_ids=tuple(list(ids) for ids in block_ids),
                is_async=self.load_async,
            )
        )

    def build_metadata(self, scheduler_output, block_ids_of) -> StepPlan:
        """The step's plan; `block_ids_of(req_id)` gives a request's blocks per group."""
        plan = StepPlan(loads=self._loads, final_saves=self._final_saves)
        self._loading = {
            load.req_id: {b for ids in load.block_ids for b in ids} for load in self._loads
        }
        self._loads, self._final_saves = [], []
        self._promised_pages = 0
        page_size = self.page_size
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
                continue  # no full page, or the caches hold them all already
            num_blocks = -(-num_tokens // self.block_size)
            plan.saves.append(
                SaveSpec(
                    req_id=req_id,
                    token_ids=list(request.prompt_token_ids[:num_tokens]),
                    extra_key=tracked.extra_key,
                    block_ids=tuple(list(ids[:num_blocks]) for ids in block_ids_of(req_id)),
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

    def failed_loads(self, req_ids) -> None:
        """Asynchronous loads that failed: vLLM recomputes those requests from token 0."""
        for req_id in req_ids:
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.saved = False
            self._lookups.pop(req_id, None)

    def finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The request ended. With full pages past its prompt (its answer), they are saved
        in the next step, whole, and vLLM keeps the blocks until the worker reports it."""
        tracked = self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._finding.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        computed = min(request.num_computed_tokens, request.num_tokens - 1)  # KV in blocks
        num_tokens = computed // self.page_size * self.page_size
        if num_tokens <= request.num_prompt_tokens // self.page_size * self.page_size:
            return False, None  # no page past the prompt (saved when it was computed)
        self._final_saves.append(
            SaveSpec(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids[:num_tokens]),
                extra_key=tracked.extra_key,
                block_ids=tuple(
                    list(ids[: -(-num_tokens // self.block_size)]) for ids in block_ids
                ),
            )
        )
        self.sending.add(request.request_id)
        return True, None

    def sent(self, req_ids) -> None:
        """The workers report these final saves done: vLLM frees their blocks."""
        self.sending.difference_update(req_ids)
