"""Workloads for the simulator: Mooncake JSONL traces and a seeded conversation generator.

A `Trace` is a list of `Request`s in arrival order. A request knows its prompt only as a
recipe (Mooncake block ids, or a slice of its session's token stream) and builds the
prompt's tokens when asked, in the radix index's own encoding, so a 61 M-token trace costs
a few megabytes until it is played.

Mooncake traces (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token
prefix-chained blocks) become tokens as the trace's README says: token j of block h is
h*512 + j, and the last block is cut to the request's length; equal block ids give equal
tokens. The generator builds multi-turn conversations that open with one of a few shared
system prompts, so both kinds of prefix sharing in real chat traffic are there.

This module knows nothing about caches or time models.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from hicache.simulate.errors import TraceError

MOONCAKE_BLOCK_TOKENS = 512
_TOKEN_DTYPE = np.dtype("<u4")  # the radix index's encoding (radix.keys.encode_tokens)
_MAX_BLOCK_ID = (2**32 - 1) // MOONCAKE_BLOCK_TOKENS
_BLOCK_OFFSETS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=_TOKEN_DTYPE)


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: when it arrives, how long it is, and how to build its tokens.

    Exactly one of `block_ids` (Mooncake) and `stream` (generated: the prompt is
    `stream[:input_length]`) is set.
    """

    arrival_s: float
    input_length: int
    output_length: int
    block_ids: np.ndarray | None = None
    stream: np.ndarray | None = None
    session: int = -1

    def token_bytes(self) -> bytes:
        """The prompt as little-endian uint32 bytes (what `HiCache.match` takes as is)."""
        if self.block_ids is not None:
            starts = self.block_ids.astype(_TOKEN_DTYPE) * np.uint32(MOONCAKE_BLOCK_TOKENS)
            tokens = (starts[:, None] + _BLOCK_OFFSETS[None, :]).reshape(-1)
            return tokens[: self.input_length].tobytes()
        return self.stream[: self.input_length].tobytes()


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order. `block_size` is the trace's own block length in tokens
    (Mooncake: 512), the natural page size to play it at; None for generated traces."""

    name: str
    requests: list[Request]
    block_size: int | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(request.input_length for request in self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def max_input_length(self) -> int:
        return max((request.input_length for request in self.requests), default=0)

    def head(self, num_requests: int) -> Trace:
        """The first `num_requests` requests (for quick runs and tests)."""
        return Trace(f"{self.name}[:{num_requests}]", self.requests[:num_requests], self.block_size)


# ---------------------------------------------------------------------------- Mooncake JSONL


def open_text(path: Path):
    """A trace file for reading as text, gzip-compressed (`.gz`) or not."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def load_mooncake(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace; every malformed line is a `TraceError` that
    names the file and line. Requests are ordered by timestamp (stable)."""
    path = Path(path)
    try:
        handle = open_text(path)
    except OSError as error:
        raise TraceError(f"{path}: cannot open the trace: {error.strerror or error}") from None
    requests: list[Request] = []
    try:
        with handle:
            for line_number, line in enumerate(handle, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                if not requests:
                    _check_format(line, path, line_number)
                requests.append(_parse_mooncake_line(line, f"{path}:{line_number}"))
    except (OSError, EOFError, zlib.error) as error:  # gzip's complaints among them
        what = "a damaged or truncated gzip file" if path.suffix == ".gz" else "unreadable"
        raise TraceError(f"{path}: cannot read the trace ({what}: {error})") from None
    except UnicodeDecodeError:
        raise TraceError(
            f"{path}: not a Mooncake JSONL trace (not UTF-8 text{_gz_hint(path)}); {_FORMATS}"
        ) from None
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    requests.sort(key=lambda request: request.arrival_s)
    return Trace(path.name, requests, MOONCAKE_BLOCK_TOKENS)


_FORMATS = (
    "--trace takes a Mooncake JSONL file (.jsonl, or .jsonl.gz compressed) or "
    "conversations[:sessions=N,...]"
)


def _gz_hint(path: Path) -> str:
    return "; compressed? name it .gz" if path.suffix != ".gz" else ""


def _check_format(first_line: str, path: Path, line_number: int) -> None:
    """The first line says whether this is a JSONL trace at all (a CSV, a JSON array, ...)."""
    try:
        record = json.loads(first_line)
    except json.JSONDecodeError:
        raise TraceError(
            f"{path}: not a Mooncake JSONL trace (line {line_number} is not a JSON object: "
            f"{first_line.strip()[:40]!r}); {_FORMATS}"
        ) from None
    if not isinstance(record, dict):
        raise TraceError(
            f"{path}: not a Mooncake JSONL trace (line {line_number} is a JSON "
            f"{type(record).__name__}, not one request per line as an object); {_FORMATS}"
        )


def _parse_mooncake_line(line: str, where: str) -> Request:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("timestamp", "input_length", "hash_ids") if k not in record]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp = record["timestamp"]
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    input_length = _int_field(record, "input_length", where, minimum=1)
    output_length = _int_field(record, "output_length", where, minimum=0, default=0)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_BLOCK_ID for h in hash_ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of block ids in [0, {_MAX_BLOCK_ID}]")
    expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
            f"{MOONCAKE_BLOCK_TOKENS}-token blocks need {expected}"
        )
    return Request(
        arrival_s=timestamp / 1000.0,
        input_length=input_length,
        output_length=output_length,
        block_ids=np.asarray(hash_ids, dtype=np.int64),
    )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(record: dict, name: str, where: str, *, minimum: int, default=None) -> int:
    value = record.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------------- generator


@dataclass(frozen=True)
class ConversationWorkload:
    """Multi-turn chat sessions that open with one of a few shared system prompts.

    Sessions arrive as a Poisson process; each picks a system prompt by a Zipf law, runs a
    geometric number of turns, and each turn's prompt is the whole conversation so far
    (system prompt, earlier user messages and answers, the new message). Lengths are
    lognormal around their means; users think an exponential time between turns.
    """

    sessions: int = 1000
    system_prompts: int = 16
    system_tokens: int = 2000  # mean length of a system prompt
    zipf: float = 1.1  # popularity skew of the system prompts
    turns: float = 6.0  # mean turns per session (geometric)
    user_tokens: int = 1500  # mean user message (documents and tool output included)
    output_tokens: int = 500  # mean answer
    think_s: float = 30.0  # mean pause between an answer and the next message
    rate: float = 4.0  # sessions starting per second
    max_context: int = 65536  # a session ends when its prompt would be longer
    vocab: int = 128000
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "sessions": self.sessions >= 1,
            "system_prompts": self.system_prompts >= 1,
            "system_tokens": self.system_tokens >= 0,
            "zipf": self.zipf >= 0,
            "turns": self.turns >= 1,
            "user_tokens": self.user_tokens >= 1,
            "output_tokens": self.output_tokens >= 0,
            "think_s": self.think_s >= 0,
            "rate": self.rate > 0,
            "max_context": self.max_context >= 1,
            "vocab": 1 <= self.vocab <= 2**32,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "ConversationWorkload: out of range: "
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            )

    @classmethod
    def from_spec(cls, spec: str) -> ConversationWorkload:
        """Parse "sessions=800,turns=6,seed=3" (any field, comma separated)."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in known:
                raise ValueError(
                    f"conversations: cannot read {item!r}; use name=value with names "
                    f"{', '.join(known)}"
                )
            default = getattr(cls, name)
            try:
                values[name] = int(raw) if isinstance(default, int) else float(raw)
            except ValueError:
                kind = "an integer" if isinstance(default, int) else "a number"
                raise ValueError(f"conversations: {name} must be {kind}, got {raw!r}") from None
        return cls(**values)


def generate_conversations(workload: ConversationWorkload | None = None) -> Trace:
    """A seeded conversation trace (same workload and seed, same trace)."""
    w = workload or ConversationWorkload()
    rng = np.random.default_rng(w.seed)
    system = [
        _random_tokens(rng, _lognormal_length(rng, w.system_tokens), w.vocab)
        for _ in range(w.system_prompts)
    ]
    ranks = np.arange(1, w.system_prompts + 1, dtype=np.float64)
    popularity = ranks**-w.zipf
    popularity /= popularity.sum()
    starts = np.cumsum(rng.exponential(1.0 / w.rate, size=w.sessions))
    requests: list[Request] = []
    for session, start_s in enumerate(starts):
        prompt = system[rng.choice(w.system_prompts, p=popularity)]
        num_turns = int(rng.geometric(1.0 / w.turns))
        requests.extend(_session_requests(rng, w, session, float(start_s), prompt, num_turns))
    requests.sort(key=lambda request: request.arrival_s)
    return Trace(f"conversations(seed={w.seed})", requests, None)


def _session_requests(
    rng, w: ConversationWorkload, session: int, start_s: float, prompt, num_turns: int
) -> list[Request]:
    pieces = [prompt]
    turns = []  # (arrival_s, input_length, output_length)
    length = len(prompt)
    arrival_s = start_s
    for _ in range(num_turns):
        user = _random_tokens(rng, _lognormal_length(rng, w.user_tokens), w.vocab)
        answer_length = _lognormal_length(rng, w.output_tokens) if w.output_tokens else 0
        if length + len(user) > w.max_context:
            break
        pieces.append(user)
        length += len(user)
        turns.append((arrival_s, length, answer_length))
        pieces.append(_random_tokens(rng, answer_length, w.vocab))
        length += answer_length
        arrival_s += float(rng.exponential(w.think_s)) if w.think_s else 0.0
    stream = np.concatenate(pieces) if pieces else np.empty(0, dtype=_TOKEN_DTYPE)
    return [
        Request(arrival_s=t, input_length=n, output_length=o, stream=stream, session=session)
        for t, n, o in turns
    ]


def _lognormal_length(rng, mean: int, sigma: float = 0.6) -> int:
    if mean <= 0:
        return 0
    # mean of a lognormal is exp(mu + sigma^2 / 2)
    return max(1, int(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma)))


def _random_tokens(rng, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=length, dtype=np.uint32).astype(_TOKEN_DTYPE, copy=False)


# ---------------------------------------------------------------------------- by name

CONVERSATIONS = "conversations"
# Traces shipped in the package (package data, so an installed wheel has them), by name.
BUNDLED_DIR = Path(__file__).resolve().parent / "traces"
BUNDLED = {"mooncake": BUNDLED_DIR / "mooncake_synthetic_trace.jsonl.gz"}


def load_trace(spec: str, limit: int | None = None) -> Trace:
    """A trace from the CLI's `--trace`: a JSONL path, a bundled trace's name (`BUNDLED`),
    or "conversations[:k=v,...]"."""
    if spec == CONVERSATIONS or spec.startswith(CONVERSATIONS + ":"):
        workload = ConversationWorkload.from_spec(spec[len(CONVERSATIONS) + 1 :])
        trace = generate_conversations(workload)
    else:
        trace = load_mooncake(BUNDLED.get(spec, spec), limit)
    return trace.head(limit) if limit is not None and limit < trace.num_requests else trace
