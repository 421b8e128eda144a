"""The work behind `hicache demo`: run the chat workload with the cache on, then off, and
print a per-turn comparison (see `engine_integration.demo` for the command line)."""

from __future__ import annotations

import collections
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine_integration.config import EngineConfig
from engine_integration.demo import DemoConfig, default_l3_dir
from engine_integration.embedded import CacheSizes, build_cache, load_model
from engine_integration.engine import Engine
from engine_integration.request import RequestOutput
from engine_integration.sampling import SamplingParams
from engine_integration.workload import make_conversations, turn_text
from hicache.config import PolicyConfig


@dataclass
class TurnRecord:
    turn: int
    user: int
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    hit: dict[str, int] = field(default_factory=dict)
    replayed: int = 0
    computed: int = 0
    ttft_s: float = 0.0
    ttft_off_s: float | None = None
    same: bool | None = None

    @property
    def hit_total(self) -> int:
        return sum(self.hit.values())


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(config: DemoConfig) -> int:
    torch.set_num_threads(config.threads)
    engine_config = EngineConfig(
        device=config.device,
        page_size=config.page_size,
        max_running_requests=config.concurrency,
    )
    l3_url = config.l3_url or _default_l3_url(config)
    model, tokenizer = load_model(config.model_dir, engine_config, seed=config.seed)
    sizes = CacheSizes(
        config.l1_pages,
        config.l2_pages,
        l3_url if config.l2_pages else None,
        # Every page backed up at once (so L3 fills as the run goes), and a match waits
        # for all its L3 pages: the demo's hits do not depend on how busy the machine is.
        PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete"),
    )
    cache = build_cache(model, engine_config, sizes)
    _say(
        f"hicache demo: {config.users} users x {config.turns} turns, {model.config.model_id} "
        f"on {config.device}; L1 {config.l1_pages} pages, L2 {config.l2_pages} pages, "
        f"L3 {sizes.l3_url or 'off'} ({config.page_size} tokens a page)"
    )
    conversations = make_conversations(config.users, config.turns, config.seed)
    _warm_up(model, engine_config)
    started = time.perf_counter()
    try:
        engine = Engine(model, engine_config, cache=cache)
        _say("\nwith the cache on:")
        records = _run_chats(engine, tokenizer, conversations, config)
        cache.flush()
        stats = cache.stats()
    finally:
        cache.close()
    if config.compare:
        promise = (
            "so the outputs must match"
            if engine_config.invariant
            else "outputs equal up to rounding: bf16 kernels round by batch shape"
        )
        _say(f"\nwith the cache off (same prompts, unsplit, {promise}):")
        _run_cache_off(model, engine_config, records, config)
    _print_table(records, config.compare)
    _print_totals(records, stats, sizes.l3_url, time.perf_counter() - started)
    return 0


def _warm_up(model, engine_config: EngineConfig) -> None:
    """One untimed request, so that first-call costs do not land on the first turn."""
    engine = Engine(model, engine_config, num_private_pages=4)
    prompt = [i % model.config.vocab_size for i in range(100)]
    engine.generate([prompt], SamplingParams(max_new_tokens=2))


def _default_l3_url(config: DemoConfig) -> str:
    directory = default_l3_dir()
    if config.fresh and directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return f"file://{directory}?capacity={config.l3_capacity}"


# ---------------------------------------------------------------------- running


def _run_chats(engine: Engine, tokenizer, conversations, config: DemoConfig) -> list[TurnRecord]:
    """Turn t of every user, then turn t + 1; at most `concurrency` requests in flight."""
    histories = {c.user: [] for c in conversations}
    records: list[TurnRecord] = []

    def prompt_for(record: TurnRecord) -> list[int]:
        text = turn_text(conversations[record.user], record.turn)
        record.prompt = histories[record.user] + tokenizer.encode(text)
        return record.prompt

    def done(record: TurnRecord, output: RequestOutput) -> None:
        metrics = output.metrics
        record.output = output.token_ids
        record.hit = dict(metrics.hit_tokens)
        record.replayed = metrics.replayed_tokens
        record.computed = metrics.computed_tokens
        record.ttft_s = metrics.ttft_s
        histories[record.user] = record.prompt + record.output
        tiers = " | ".join(f"{t.upper()} {n:,}" for t, n in record.hit.items())
        _say(
            f"  turn {record.turn} user {record.user}: {len(record.prompt):,} prompt tokens, "
            f"{record.hit_total:,} from the cache ({tiers}), {record.replayed} replayed, "
            f"TTFT {record.ttft_s * 1e3:.0f} ms"
        )

    for turn in range(config.turns):
        records.extend(TurnRecord(turn, c.user) for c in conversations)
    _run_schedule(engine, records, config, prompt_for, done)
    return records


def _run_cache_off(model, engine_config: EngineConfig, records, config: DemoConfig) -> None:
    longest = max(len(r.prompt) for r in records) + config.max_new_tokens
    pages = config.concurrency * -(-longest // config.page_size)
    engine = Engine(model, engine_config, num_private_pages=pages)

    def prompt_for(record: TurnRecord) -> list[int]:
        return record.prompt

    def done(record: TurnRecord, output: RequestOutput) -> None:
        record.ttft_off_s = output.metrics.ttft_s
        record.same = output.token_ids == record.output
        _say(
            f"  turn {record.turn} user {record.user}: TTFT {record.ttft_off_s * 1e3:.0f} ms, "
            f"output {'identical' if record.same else 'DIFFERENT'}"
        )

    _run_schedule(engine, records, config, prompt_for, done)


def _run_schedule(
    engine: Engine,
    records: list[TurnRecord],
    config: DemoConfig,
    prompt_for: Callable[[TurnRecord], list[int]],
    done: Callable[[TurnRecord, RequestOutput], None],
) -> None:
    """Submit records in order, keeping `concurrency` in flight; a user's next turn waits
    for its previous answer."""
    pending = collections.deque(records)
    in_flight: dict[str, TurnRecord] = {}
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    while pending or in_flight:
        while pending and len(in_flight) < config.concurrency:
            record = pending[0]
            if any(r.user == record.user for r in in_flight.values()):
                break
            pending.popleft()
            request_id = f"turn{record.turn}-user{record.user}"
            engine.add_request(prompt_for(record), params, request_id=request_id)
            in_flight[request_id] = record
        for output in engine.step():
            done(in_flight.pop(output.request_id), output)


# ---------------------------------------------------------------------- the report


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms"


def _print_table(records: list[TurnRecord], compare: bool) -> None:
    header = [
        "turn",
        "user",
        "prompt",
        "L1 hit",
        "L2 hit",
        "L3 hit",
        "replay",
        "computed",
        "TTFT on",
    ]
    if compare:
        header += ["TTFT off", "speedup", "same"]
    rows = []
    for r in records:
        row = [
            r.turn,
            r.user,
            f"{len(r.prompt):,}",
            f"{r.hit['l1']:,}",
            f"{r.hit['l2']:,}",
            f"{r.hit['l3']:,}",
            f"{r.replayed:,}",
            f"{r.computed:,}",
            _ms(r.ttft_s),
        ]
        if compare:
            speedup = r.ttft_off_s / r.ttft_s if r.ttft_s else 0.0
            row += [_ms(r.ttft_off_s), f"{speedup:.1f}x", "yes" if r.same else "NO"]
        rows.append([str(cell) for cell in row])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    _say()
    _say("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        _say("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def _print_totals(records: list[TurnRecord], stats, l3_url: str | None, seconds: float) -> None:
    prompt = sum(len(r.prompt) for r in records)
    hits = {tier: sum(r.hit[tier] for r in records) for tier in ("l1", "l2", "l3")}
    hit = sum(hits.values())
    computed = sum(r.computed for r in records)
    replayed = sum(r.replayed for r in records)
    ttft_on = sum(r.ttft_s for r in records) / len(records)
    _say()
    _say(f"totals: {len(records)} requests, {prompt:,} prompt tokens")
    _say(
        f"  from the cache: {hit:,} tokens ({hit / prompt:.0%}): L1 {hits['l1']:,}, "
        f"L2 {hits['l2']:,}, L3 {hits['l3']:,}"
    )
    _say(
        f"  prefill computed: {computed:,} new tokens + {replayed:,} replayed "
        f"(cache off: {prompt:,})"
    )
    line = f"  mean TTFT: {_ms(ttft_on)} with the cache"
    if records[0].ttft_off_s is not None:
        ttft_off = sum(r.ttft_off_s for r in records) / len(records)
        same = sum(1 for r in records if r.same)
        line += (
            f", {_ms(ttft_off)} without ({ttft_off / ttft_on:.1f}x); "
            f"outputs identical: {same}/{len(records)}"
        )
    _say(line)
    moved = stats.pages_moved
    _say(
        f"  pages moved: L1->L2 {moved['l1_to_l2']:,}, L2->L1 {moved['l2_to_l1']:,}, "
        f"L2->L3 {moved['l2_to_l3']:,}, L3->L2 {moved['l3_to_l2']:,}; evicted from L1 "
        f"{stats.evicted_pages['l1']:,}, from L2 {stats.evicted_pages['l2']:,}"
    )
    if l3_url:
        _say(f"  L3 is {l3_url}: run `hicache demo` again and a new process, with empty L1")
        _say("  and L2, starts from the pages this run left there (--fresh empties it).")
    _say(f"  ({seconds:.1f} s)")
    sys.stdout.flush()
