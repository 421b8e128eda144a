"""What bench_serving.py sends and what it sees: a trace request's prompt token ids, the
open-loop streaming client that replays them (one `Outcome` per request), and the per-run
figures summed from those outcomes. The deployment it is sent to (serving_deployment.py) and
the runner (bench_serving.py) build on it; it imports neither."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from hicache.simulate.trace import Request as TraceRequest

MOONCAKE_BLOCK = 512  # tokens per hash id in a Mooncake trace
PROMPT_SEED = 20261205  # the token ids of every block id (same ids, same tokens, any run)


# ---------------------------------------------------------------------------- prompts


def block_tokens_of(block_id: int, block_tokens: int, vocab_size: int) -> np.ndarray:
    """The `block_tokens` token ids of Mooncake block `block_id`: a function of the id
    alone (seeded by it), so equal ids give equal tokens in every request and run."""
    rng = np.random.default_rng([PROMPT_SEED, block_id])
    return rng.integers(0, vocab_size, size=block_tokens, dtype=np.int64)


def prompt_length(request: TraceRequest, block_tokens: int) -> int:
    """A Mooncake request's prompt length at `block_tokens` tokens per block: its full
    blocks whole, its last block cut in the trace's proportion (at least one token)."""
    num_blocks = len(request.block_ids)
    last = request.input_length - MOONCAKE_BLOCK * (num_blocks - 1)
    return (num_blocks - 1) * block_tokens + max(1, -(-last * block_tokens // MOONCAKE_BLOCK))


def prompt_ids(request: TraceRequest, block_tokens: int, vocab_size: int) -> list[int]:
    """The token ids a trace request is sent as (see bench_serving.py's docstring)."""
    if request.block_ids is None:  # generated: the session's stream, in the vocabulary
        stream = request.stream[: request.input_length].astype(np.int64)
        return (stream % vocab_size).tolist()
    blocks = [block_tokens_of(int(h), block_tokens, vocab_size) for h in request.block_ids]
    return np.concatenate(blocks)[: prompt_length(request, block_tokens)].tolist()


# ---------------------------------------------------------------------------- the client


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from the run's start)."""

    index: int
    prompt_tokens: int
    sent_s: float = 0.0
    late_s: float = 0.0  # sent this long after its arrival time (the client's own lag)
    ttft_s: float | None = None
    tpot_s: float | None = None
    done_s: float | None = None
    output_tokens: int = 0
    hit_tokens: dict = field(default_factory=dict)
    computed_tokens: int = 0
    replayed_tokens: int = 0
    replica: str | None = None
    error: str | None = None


async def send_one(session, url: str, index: int, ids: list[int], max_tokens: int,
                   arrival_s: float, start: float) -> Outcome:  # fmt: skip
    """Wait for the request's arrival time, send it streamed, read it to the end."""
    await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
    outcome = Outcome(index, len(ids))
    sent = time.perf_counter()
    outcome.sent_s, outcome.late_s = sent - start, max(0.0, sent - start - arrival_s)
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    first = last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                outcome.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return outcome
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    outcome.error = event["error"]["message"]
                    return outcome
                if event.get("hicache", {}).get("token_ids"):
                    last = time.perf_counter()
                    first = first or last
                if "usage" in event:
                    _take_final(outcome, event)
    except (OSError, asyncio.TimeoutError) as error:  # aiohttp's ClientError is an OSError
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    if first is None or outcome.replica is None:
        outcome.error = outcome.error or "the stream ended without tokens or final stats"
        return outcome
    outcome.ttft_s, outcome.done_s = first - sent, last - start
    if outcome.output_tokens > 1:
        outcome.tpot_s = (last - first) / (outcome.output_tokens - 1)
    return outcome


def _take_final(outcome: Outcome, event: dict) -> None:
    stats = event["hicache"]
    outcome.output_tokens = int(event["usage"]["completion_tokens"])
    outcome.hit_tokens = {
        tier: int(stats["hit_tokens"].get(tier, 0)) for tier in ("l1", "l2", "l3")
    }
    outcome.computed_tokens = int(stats["computed_tokens"])
    outcome.replayed_tokens = int(stats.get("replayed_tokens", 0))
    outcome.replica = stats["replica"]


async def replay(url: str, work: list[tuple[float, list[int], int]]) -> list[Outcome]:
    """Every (arrival_s, prompt ids, max_tokens) of `work`, open loop."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter() + 0.05
        tasks = [
            send_one(session, url, i, ids, max_tokens, arrival_s, start)
            for i, (arrival_s, ids, max_tokens) in enumerate(work)
        ]
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------------- summaries


def percentiles(values: list[float], points=(50, 90, 99)) -> dict:
    if not values:
        return {f"p{p}": None for p in points}
    return {f"p{p}": round(float(np.percentile(values, p)) * 1000, 2) for p in points}


def summarize(outcomes: list[Outcome], ttft_target_ms: float) -> dict:
    """The per-run figures of one configuration (see bench_serving.py's docstring)."""
    done = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft_s for o in done]
    hit = {tier: sum(o.hit_tokens[tier] for o in done) for tier in ("l1", "l2", "l3")}
    hit["computed"] = sum(o.computed_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    first_s = min((o.sent_s for o in done), default=0.0)
    span_s = max((o.done_s for o in done), default=0.0) - first_s
    met = sum(1 for t in ttfts if t * 1000 <= ttft_target_ms)
    return {
        "requests": len(outcomes),
        "answered": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "prompt_tokens": sum(o.prompt_tokens for o in done),
        "output_tokens": output_tokens,
        "hit_tokens": hit,
        "replayed_tokens": sum(o.replayed_tokens for o in done),
        "ttft_ms": percentiles(ttfts),
        "tpot_ms": percentiles([o.tpot_s for o in done if o.tpot_s is not None], (50, 90)),
        "duration_s": round(span_s, 3),
        "throughput_tok_s": round(output_tokens / span_s, 2) if span_s > 0 else None,
        "total_tok_s": round((output_tokens + sum(o.prompt_tokens for o in done)) / span_s, 2)
        if span_s > 0
        else None,
        "goodput": round(met / span_s, 3) if span_s > 0 else None,
        "goodput_share": round(met / len(outcomes), 4) if outcomes else None,
        "max_send_lag_ms": round(1000 * max((o.late_s for o in outcomes), default=0.0), 2),
        "per_replica": _per_replica(done),
    }


def _per_replica(done: list[Outcome]) -> dict:
    counts: dict[str, int] = {}
    for outcome in done:
        counts[outcome.replica] = counts.get(outcome.replica, 0) + 1
    return dict(sorted(counts.items()))
