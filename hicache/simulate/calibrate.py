"""`hicache simulate --calibrate URL`: a hardware profile from a running replica.

It sends the replica a few cold prompts of several lengths (random token ids below its
tokenizer's size, which `/hicache/info` gives; one output token each), so that its compute
fit has samples across rows and attention pairs: prompts up to the prefill chunk (one
engine step each, rows across the range), and prompts of several chunks where half the
replica's L1 holds one (steps whose rows attend over a prefix already computed, which is
what tells the cost of a pair from the cost of a row: on a GPU a chunk or less costs little
more than a step's fixed time whatever its length). Then it reads `GET /v1/hicache/profile`
and returns it checked (`hicache.simulate.profile`), with the request overhead: the median
of the prompts' wall times less their fitted steps.

Before reading it, it sends each round's longest prompt again, oldest first: L1 or L2 hits
(loads, which sample the L2 link), or L3 hits on a replica whose L1 holds about one of them
and L2 two. On a replica with an L3 that has not read from it yet, it then sends as many
more prompts as its L1 and L2 hold (their sizes from `/hicache/info`) and the two oldest
of those again: they come back from L3 (the first read of a cache is no sample of the
store's rate, the second is), so the profile's L3 read rate is measured, not the prior,
whatever the replica's sizes (on a CPU that is most of the calibration's time). The
prompts go into the replica's cache like any others: calibrate a replica before its
measured run, or one started for the purpose. A replica still starting (its port not yet
open, or loading its model) is waited for, up to `wait_s`. Stdlib HTTP only (torch-free).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
import urllib.error
import urllib.request
from typing import Any

from hicache.simulate.errors import SimulationError
from hicache.simulate.profile import PROFILE_PATH, HardwareProfile, profile_from_dict

INFO_PATH = "/hicache/info"  # the replica's own facts: the ids a prompt may hold among them
WARMUP_LENGTHS = (64, 128, 256, 512, 1024, 2048)  # cut at the replica's prefill chunk
WARMUP_CHUNKS = (2, 4)  # prompts of this many chunks too, where half the replica's L1 holds one
MAX_FILL_PROMPTS = 64  # prompts that push the warm-up out of L1 and L2 into L3, at most
MAX_PROMPT_TOKENS = 1 << 16  # the longest prompt sent, whatever a replica says it takes
_TIMEOUT_S = 300.0
WAIT_S = 120.0  # for a replica that is still starting


def calibrate(
    url: str, *, rounds: int = 3, seed: int = 0, wait_s: float = WAIT_S, through_l3: bool = True
) -> HardwareProfile:
    """The replica at `url`'s profile, after `rounds` warm-up prompts of each length;
    `through_l3=False`: no more prompts to reach an L3 the warm-up did not read from (its
    rate stays the prior, as a replica's does until it reads)."""
    if rounds < 0:
        raise SimulationError(f"--calibrate-rounds must be >= 0, got {rounds}")
    if not 0 <= wait_s <= 3600:
        raise SimulationError(f"--calibrate-wait must be in [0, 3600] seconds, got {wait_s}")
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise SimulationError(f"--calibrate {url}: expected an http:// or https:// URL")
    where = f"--calibrate {url}"
    _wait_until_up(base + "/health", where, wait_s)
    first = _get(base + PROFILE_PATH, where)
    if not isinstance(first, dict) or not isinstance(first.get("model"), dict):
        raise SimulationError(f"{where}: the reply is not a hardware profile")
    info = _get(base + INFO_PATH, where)
    info = info if isinstance(info, dict) else {}
    vocab = _prompt_vocab(info, first["model"].get("vocab_size"))
    chunk = first.get("prefill_chunk_tokens")
    if not isinstance(vocab, int) or vocab < 2 or not isinstance(chunk, int) or chunk < 1:
        raise SimulationError(f"{where}: the profile has no usable vocab_size/prefill chunk")
    send = _Sender(base, where, vocab, random.Random(seed))
    lengths = warmup_lengths(chunk, _l1_tokens(info))
    walls = _warm_up(send, lengths, rounds)
    data = _get(base + PROFILE_PATH, where)
    if through_l3 and rounds and isinstance(data, dict) and not data.get("num_read_samples"):
        _through_l3(send, info, lengths[-1])
        data = _get(base + PROFILE_PATH, where)
    if isinstance(data, dict) and data.get("compute") is None:
        raise SimulationError(
            f"{where}: the replica has not fitted its step costs yet (it needs 3 steps); "
            "give --calibrate-rounds 1 or more"
        )
    if isinstance(data, dict):
        data = {**data, "source": url}
    profile = profile_from_dict(data, where)
    return dataclasses.replace(profile, request_overhead_s=_overhead_s(profile, walls))


def _warm_up(send: _Sender, lengths: list[int], rounds: int) -> list[tuple[int, float]]:
    """`rounds` prompts of each length, then each round's longest again, oldest first (hits
    from wherever they went: L2, L3). Returns each first send's (length, wall seconds)."""
    walls = []
    longest = []
    for _ in range(rounds):
        for length in lengths:
            prompt = send.draw(length)
            began = time.perf_counter()
            send.again(prompt)
            walls.append((length, time.perf_counter() - began))
        longest.append(prompt)
    for prompt in longest:
        send.again(prompt)
    return walls


def warmup_lengths(chunk: int, l1_tokens: int) -> list[int]:
    """The warm-up prompts' lengths: those of `WARMUP_LENGTHS` up to the prefill `chunk`
    (one step each), then `WARMUP_CHUNKS` chunks where half of `l1_tokens` holds them; none
    past `MAX_PROMPT_TOKENS`."""
    chunk = min(chunk, MAX_PROMPT_TOKENS)
    lengths = [n for n in WARMUP_LENGTHS if n <= chunk] or [chunk]
    limit = min(l1_tokens // 2, MAX_PROMPT_TOKENS)
    return lengths + [k * chunk for k in WARMUP_CHUNKS if k * chunk <= limit]


def fill_prompts(info: dict, length: int) -> int:
    """How many prompts of `length` tokens push what came before out of the replica's L1
    and L2 into its L3 (0 for a replica without an L3), at most `MAX_FILL_PROMPTS`."""
    if info.get("l3") is not True:
        return 0
    l2_tokens = _int(info.get("l2_pages")) * _int(info.get("page_size"))
    return min(MAX_FILL_PROMPTS, -(-(_l1_tokens(info) + l2_tokens) // length) + 1)


def _through_l3(send: _Sender, info: dict, length: int) -> None:
    """Prompts enough to push the first of them into L3 alone, then the two oldest again
    (the second read from L3 is the first sample of its rate)."""
    filled = [send.new(length) for _ in range(fill_prompts(info, length))]
    for prompt in filled[:2]:
        send.again(prompt)


def _l1_tokens(info: dict) -> int:
    return _int(info.get("l1_pages")) * _int(info.get("page_size"))


def _int(value: Any) -> int:
    """A count a replica stated (0 where it did not, or not as a count)."""
    return value if type(value) is int and value > 0 else 0


class _Sender:
    """Sends the replica prompts of random ids below `vocab`, one output token each."""

    def __init__(self, base: str, where: str, vocab: int, generator: random.Random) -> None:
        self.base, self.where, self.vocab, self.generator = base, where, vocab, generator

    def draw(self, length: int) -> list[int]:
        return [self.generator.randrange(self.vocab) for _ in range(length)]

    def new(self, length: int) -> list[int]:
        prompt = self.draw(length)
        self.again(prompt)
        return prompt

    def again(self, prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        _post(self.base + "/v1/completions", body, self.where)


def _prompt_vocab(info: Any, model_vocab: Any) -> Any:
    """The token ids a prompt may hold: those below the replica's tokenizer size, which a
    model whose embedding outgrows its tokenizer (the benchmarks' random-weight models over
    the byte-level one, a checkpoint padded for its kernels) does not share; the model's
    size where the replica does not say."""
    said = info.get("vocab_size") if isinstance(info, dict) else None
    if isinstance(said, int) and isinstance(model_vocab, int):
        return min(said, model_vocab)
    return model_vocab


def _wait_until_up(url: str, where: str, wait_s: float) -> None:
    """Return once `url` answers at all (any HTTP status); a refused or reset connection is
    a replica still starting, tried again until `wait_s` has passed."""
    end = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=min(_TIMEOUT_S, max(wait_s, 1.0))):
                return
        except urllib.error.HTTPError:
            return  # it answers: what it answers is for the calls that follow
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() >= end:
                reason = getattr(error, "reason", error)
                raise SimulationError(
                    f"{where}: cannot reach {url} within {wait_s:.0f} s (--calibrate-wait): "
                    f"{reason}"
                ) from None
        time.sleep(0.5)


def _overhead_s(profile: HardwareProfile, walls: list[tuple[int, float]]) -> float:
    """The median of each warm-up request's wall time less its one fitted step (0 without
    warm-up requests; never below 0)."""
    if not walls:
        return 0.0
    rest = [wall - profile.prefill_s(0, length) for length, wall in walls]
    return max(0.0, statistics.median(rest))


def _get(url: str, where: str) -> Any:
    return _request(urllib.request.Request(url), where)


def _post(url: str, body: dict, where: str) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return _request(request, where)


def _reason(error: urllib.error.HTTPError) -> str:
    """The error message of an OpenAI-style error body, on one line (else nothing)."""
    try:
        message = json.loads(error.read(4096))["error"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return ": " + " ".join(str(message).split())[:300]


def _request(request: urllib.request.Request, where: str) -> Any:
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as reply:
            raw = reply.read(16 << 20)
    except urllib.error.HTTPError as error:
        raise SimulationError(
            f"{where}: {request.full_url} answered HTTP {error.code}"
            + (" (is it a `hicache engine serve` replica?)" if error.code == 404 else "")
            + _reason(error)
        ) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise SimulationError(f"{where}: cannot reach {request.full_url}: {reason}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SimulationError(f"{where}: {request.full_url} did not answer JSON") from None
