"""A request's state through the engine, and what the engine hands back.

Life: WAITING (queued; the scheduler has asked the cache to prefetch its prefix) ->
PREFILL (admitted: matched, its pages reserved; encoder replay, then the uncached prompt
in chunks) -> DECODE -> FINISHED (its pages inserted into the cache, its match released).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine_integration.engine.model.window import LateWindow
from engine_integration.engine.sampling import SamplingParams
from radix.keys import TOKEN_BYTES


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """What one request cost and what the cache gave it.

    hit_tokens:      prompt tokens served from the cache, by the tier they came from.
    replayed_tokens: cached tokens run again through the model to rebuild the late window.
    computed_tokens: prompt tokens whose source KV this request computed.
    late_tokens:     prompt rows that went through the late layers.
    window_cut_tokens: (interleaved models) tokens the cache held past the hit served,
                     cut for lack of a whole sidecar there (engine/sidecar.py).
    ttft_s:          arrival to first token.
    """

    prompt_tokens: int
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0, "l3": 0})
    replayed_tokens: int = 0
    computed_tokens: int = 0
    late_tokens: int = 0
    window_cut_tokens: int = 0
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    metrics: RequestMetrics
    logits: torch.Tensor | None  # (len(token_ids), vocab) float32, if asked for


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    encoded_prompt: bytes = b""  # the prompt in the cache's token encoding (uint32 LE)
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    l3_asked_s: float | None = None  # when L3 was last asked about it (monotonic clock)
    # set on admission
    match: object | None = None  # hicache Match (locked) or None
    page_ids: list[int] = field(default_factory=list)  # match pages first, then our own
    page_table: torch.Tensor | None = None
    window: LateWindow | None = None
    generator: torch.Generator | None = None
    cursor: int = 0  # next prompt position to run
    hit_tokens: int = 0  # the prefix the cache supplied: its KV and boundary residual
    late_runs: list[tuple[int, int]] = field(default_factory=list)  # prompt rows for late layers
    loads_waited: bool = False
    sidecar_at: list[int] = field(default_factory=list)  # boundaries to take sidecars at
    # taken: boundary -> KV (None: the whole sidecar its hit was served from)
    sidecars: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def lookup_tokens(self) -> bytes:
        """The prompt but its last token (whose logits are needed), encoded once for every
        lookup of the cache (prefetch, match)."""
        return self.encoded_prompt[:-TOKEN_BYTES]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list."""
        prompt_len = len(self.prompt)
        if end <= prompt_len:
            return self.prompt[start:end]
        if start >= prompt_len:
            return self.output[start - prompt_len : end - prompt_len]
        return self.prompt[start:] + self.output[: end - prompt_len]

    def to_output(self) -> RequestOutput:
        logits = torch.stack(self.logits) if self.logits else None
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.output),
            finish_reason=self.finish_reason or "",
            metrics=self.metrics,
            logits=logits,
        )
