"""Continuous batching: which requests run, and which of their rows, in each step.

Admission (first come, first served, up to `max_running_requests`): the request's prompt
is matched against the cache (all but its last token, whose logits are needed), and L1
pages for the rest of its life (prompt + max_new_tokens) are reserved at once, so a
running request never waits for memory and is never preempted. A request whose pages do
not fit yet waits for running ones to finish; one that could never fit is refused at
`add`. L3 is asked about a request when it is queued (`prefetch`), and again at an
admission only once that answer is `L3Config.ask_again_s` old: until then the match
reads the index, which holds what L3 had, so a request waiting for room costs no round trip
a step.

Each step carries one decode row per decoding request and, within `prefill_chunk_tokens`,
the next chunk of each prefilling request's prompt: replay rows first (after a hit), then
new rows.

The late layers' plan for a prompt of L tokens (DESIGN.md "Sliding-window layers and encoder
replay"): K stacked window layers of width W make the last position depend on the source
layers' output at the last R = K * (W - 1) + 1 positions, and so do the late layers' windows
that decoding reads (layer j's last W keys need layer j - 1's output at W + (K - 1 - j) *
(W - 1) positions). So the rows [max(0, L - R), L) go through the late layers, in a cold
prefill and after a hit alike: the result is the checkpoint's own model, the unsplit prefill,
whatever the boundary. After a hit of H tokens, the cached rows among them, [L - R, H), are
*replayed* through the late layers only: their input, the source layers' output, is stored
with the source KV in every page (the boundary residual, `ModelConfig.num_boundary_layers`),
so a hit's source layers compute its uncached rows alone. The replay runs in the request's
first step, before the step's own rows.

An interleaved model's windowed layers keep their KV in the request's ring (`Request.window`,
a sidecar's span plus a page). A hit fills it from a sidecar (engine/sidecar.py), shortened
to the deepest boundary that has one; the request then takes the sidecars later requests can
hit: at its prompt's lookup end and at the depth the index held past its hit (the prefill
stops at each for a step, and the ring is copied there), and at its last full page when it
finishes (one close past a whole one as a delta over it: engine/sidecar.py).
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import torch

from engine_integration.engine import sidecar
from engine_integration.engine.errors import EngineError, RequestTooLargeError
from engine_integration.engine.model.config import EngineConfig, ModelConfig
from engine_integration.engine.model.rows import as_index
from engine_integration.engine.model.step_rows import SeqRows
from engine_integration.engine.model.window import LateWindow
from engine_integration.engine.pages import PageSource
from engine_integration.engine.request import Request, RequestState
from hicache.match import ask_l3_again
from tiers.errors import PoolExhaustedError

logger = logging.getLogger(__name__)


def replay_reach(num_late_layers: int, window_tokens: int) -> int:
    """R = K * (W - 1) + 1: the last positions of a prompt the late layers run (see above)."""
    return num_late_layers * (window_tokens - 1) + 1


def late_rows(num_tokens: int, num_late_layers: int, window_tokens: int) -> tuple[int, int]:
    """The prompt rows [start, num_tokens) that go through the late layers (see above)."""
    return max(0, num_tokens - replay_reach(num_late_layers, window_tokens)), num_tokens


def _clip(runs: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    clipped = [(max(s, start), min(e, end)) for s, e in runs]
    return [(s, e) for s, e in clipped if s < e]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        pages: PageSource,
        num_pages: int,
        *,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.pages = pages
        self.num_pages = num_pages
        self.dtype = dtype
        self.page_size = pages.page_size
        self.shape = pages.shape  # an interleaved model's sidecars (None: none)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        needed = self._pages_for(request)
        if needed > self.num_pages:
            raise RequestTooLargeError(
                f"request {request.request_id}: {request.num_prompt_tokens} prompt + "
                f"{request.params.max_new_tokens} new tokens need {needed} pages of "
                f"{self.page_size} tokens; the L1 pool has {self.num_pages}"
            )
        self.pages.prefetch(request.lookup_tokens)
        request.l3_asked_s = time.monotonic()
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_for(self, request: Request) -> int:
        positions = request.num_prompt_tokens + request.params.max_new_tokens - 1
        return -(-positions // self.page_size)

    # ------------------------------------------------------------------ admission

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            if not self._admit(request):
                if not self.running:
                    raise EngineError(
                        f"request {request.request_id} cannot get its L1 pages with nothing "
                        "else running (are pages held outside the engine?)"
                    )
                return
            self.waiting.popleft()
            self.running.append(request)

    def _admit(self, request: Request) -> bool:
        match = self.pages.match(request.lookup_tokens, ask_l3=self._ask_l3(request))
        indexed = match.num_tokens if match is not None else 0
        window = self._windowed_ring()
        whole = False
        if window is not None and indexed:  # the hit needs a sidecar too
            match, whole = self.pages.serve_window(request.lookup_tokens, match, window)
        hit = match.num_tokens if match is not None else 0
        try:
            own = self.pages.alloc(self._pages_for(request) - hit // self.page_size)
        except PoolExhaustedError:
            if match is not None:
                self.pages.abandon([], match)
            return False
        if window is not None:
            request.window = window
            request.metrics.window_cut_tokens = indexed - hit
            if self.shape is not None:
                lookup_end = (request.num_prompt_tokens - 1) // self.page_size * self.page_size
                request.sidecar_at = sorted({b for b in (indexed, lookup_end) if b > hit})
                if whole:  # the hit's sidecar: those it takes close below may be deltas on it
                    request.sidecars[hit] = None
        request.match = match
        request.page_ids = (list(match.device_page_ids) if match is not None else []) + own
        request.page_table = as_index(request.page_ids, self.config.device)  # no device sync
        self._plan_prefill(request, hit)
        request.state = RequestState.PREFILL
        return True

    def _ask_l3(self, request: Request) -> bool:
        """Whether this admission asks L3 about the request again: only once the answer to
        its last lookup (when it was queued, or at an admission that found no room) is
        `L3Config.ask_again_s` old, so that a request waiting for room costs no round trip a
        step."""
        now = time.monotonic()
        if not ask_l3_again(request.l3_asked_s, now, self.pages.l3_ask_again_s):
            return False
        request.l3_asked_s = now
        return True

    def _windowed_ring(self):
        """A new ring for an interleaved model's windowed layers (None for other models)."""
        model = self.model_config
        if not model.windowed_layers:
            return None
        return LateWindow(
            len(model.windowed_layers),
            model.window_tokens,
            model.num_kv_heads,
            model.head_dim,
            dtype=self.dtype,
            device=self.config.device,
            num_slots=self.shape.ring_slots if self.shape is not None else None,
        )

    def _plan_prefill(self, request: Request, hit: int) -> None:
        model = self.model_config
        num_tokens = request.num_prompt_tokens
        metrics = request.metrics
        if model.num_late_layers:
            late = late_rows(num_tokens, model.num_late_layers, model.window_tokens)
            request.late_runs = [late]
            request.window = LateWindow(
                model.num_late_layers,
                model.window_tokens,
                model.num_kv_heads,
                model.head_dim,
                dtype=self.dtype,
                device=self.config.device,
            )
            metrics.late_tokens = late[1] - late[0]
        request.hit_tokens = request.cursor = hit
        metrics.replayed_tokens = sum(max(0, min(e, hit) - s) for s, e in request.late_runs)
        metrics.computed_tokens = num_tokens - hit
        if request.match is not None:
            match = request.match
            for tier, pages in (
                ("l1", match.num_l1_pages),
                ("l2", match.num_l2_pages),
                ("l3", match.num_l3_pages),
            ):
                metrics.hit_tokens[tier] = pages * self.page_size
        if not request.params.greedy:
            request.generator = torch.Generator().manual_seed(request.params.seed)

    # ------------------------------------------------------------------ steps

    def schedule(self) -> list[tuple[Request, SeqRows]]:
        """Admit what fits, then the rows of every running request for one step."""
        self._admit_waiting()
        plan = []
        for request in self.running:
            if request.state == RequestState.DECODE:
                position = request.num_tokens - 1
                plan.append((request, self._rows(request, position, position + 1, True)))
        budget = self.config.prefill_chunk_tokens
        for request in self.running:
            if request.state != RequestState.PREFILL or budget <= 0:
                continue
            end = min(request.num_prompt_tokens, request.cursor + budget)
            for boundary in request.sidecar_at:  # a step ends where a sidecar is taken
                if request.cursor < boundary < end:
                    end = boundary
            budget -= end - request.cursor
            rows = self._rows(request, request.cursor, end, end == request.num_prompt_tokens)
            plan.append((request, rows))
        return plan

    def _rows(self, request: Request, start: int, end: int, want_logits: bool) -> SeqRows:
        if request.state == RequestState.DECODE:
            late = [(start, end)] if self.model_config.num_late_layers else []
        else:  # the first step also replays the cached late rows below its start
            late = _clip(request.late_runs, 0 if start == request.hit_tokens else start, end)
        wait = None
        if request.match is not None and not request.loads_waited:
            wait = functools.partial(self.pages.wait_layer, request.match)
            request.loads_waited = True
        return SeqRows(
            token_ids=request.token_slice(start, end),
            start=start,
            end=end,
            page_table=request.page_table,
            window=request.window,
            late_runs=late,
            want_logits=want_logits,
            wait_layer=wait,
        )

    def prefilled(self, request: Request, end: int) -> None:
        """A step ran the request's prompt up to `end`: take the sidecar planned there."""
        request.cursor = end
        if end in request.sidecar_at:
            kv = sidecar.snapshot(self.shape, request.window, end)
            if kv is not None:
                request.sidecars[end] = kv

    # ------------------------------------------------------------------ the end

    def finish(self, request: Request) -> None:
        """Hand the request's pages to the cache (full ones) or back (the rest), with the
        sidecars it took and that of its last full page."""
        self.running.remove(request)
        request.state = RequestState.FINISHED
        request.metrics.finish_s = time.perf_counter()
        tokens = request.tokens[: request.num_prompt_tokens + len(request.output) - 1]
        sidecars = request.sidecars
        end = len(tokens) // self.page_size * self.page_size
        if self.shape is not None and end > request.hit_tokens and end not in sidecars:
            kv = sidecar.snapshot(self.shape, request.window, end)
            if kv is not None:
                sidecars[end] = kv
        self.pages.finish(tokens, request.page_ids, request.match, sidecars)
        request.match = None
        request.sidecars = {}

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            own = request.page_ids[request.hit_tokens // self.page_size :]
            self.pages.abandon(own, request.match)
            request.match = None
        request.state = RequestState.FINISHED
        request.finish_reason = "abort"
