"""`hicache simulate --calibrate URL`: a hardware profile from a running replica.

It sends the replica a few cold prompts of several lengths (random token ids below its
tokenizer's size, which `/hicache/info` gives; one output token each: one engine step per
prompt up to the prefill chunk), so that its compute fit has samples across rows and
attention pairs, then reads `GET /v1/hicache/profile` and returns it checked
(`hicache.simulate.profile`), with the request overhead: the median of the prompts' wall
times less their fitted steps. Before reading it, it sends each round's longest prompt
again, oldest first: on a replica whose L1 holds about one of them and L2 two, over an L3,
these come back from L3 (the first read of a cache is no sample of the store's rate, the
second is), so the profile's L3 read rate is measured, not the prior; on others they are L1
or L2 hits (loads, which sample the L2 link). The prompts go into the replica's cache like
any others: calibrate a replica before its measured run, or one started for the purpose. A
replica still starting (its port not yet open, or loading its model) is waited for, up to
`wait_s`. Stdlib HTTP only (torch-free).
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
_TIMEOUT_S = 300.0
WAIT_S = 120.0  # for a replica that is still starting


def calibrate(
    url: str, *, rounds: int = 3, seed: int = 0, wait_s: float = WAIT_S
) -> HardwareProfile:
    """The replica at `url`'s profile, after `rounds` warm-up prompts of each length."""
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
    vocab = _prompt_vocab(_get(base + INFO_PATH, where), first["model"].get("vocab_size"))
    chunk = first.get("prefill_chunk_tokens")
    if not isinstance(vocab, int) or vocab < 2 or not isinstance(chunk, int) or chunk < 1:
        raise SimulationError(f"{where}: the profile has no usable vocab_size/prefill chunk")
    lengths = [n for n in WARMUP_LENGTHS if n <= chunk] or [chunk]
    generator = random.Random(seed)
    walls = []  # (prompt length, seconds from send to answer)
    longest = []  # each round's longest prompt
    for _ in range(rounds):
        for length in lengths:
            prompt = [generator.randrange(vocab) for _ in range(length)]
            began = time.perf_counter()
            _complete(base, prompt, where)
            walls.append((length, time.perf_counter() - began))
        longest.append(prompt)
    for prompt in longest:  # again, oldest first: hits from wherever they went (L2, L3)
        _complete(base, prompt, where)
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


def _complete(base: str, prompt: list[int], where: str) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    _post(base + "/v1/completions", body, where)


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
