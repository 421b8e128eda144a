"""Prefill/decode handoff through the shared L3: a `--role prefill` replica computes the
prompt into L3 (a real cache daemon, or a real redis-server), the router sends the request
on to a `--role decode` replica, which finds every full page of the prompt in L3, computes
only from the last page on, and answers what a single replica answers, token for token
(the built-in tiny model, fp32 on the CPU)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.replicas import get_json, post_json, replica, router, wait_events_applied
from tests.support.servers import RedisProcess, free_port

PAGE = 16
FLAGS = ("--page-size", str(PAGE), "--l1-pages", "128", "--l2-pages", "128")
PROMPTS = [
    "A prompt handed from the prefill replica to the decode replica through L3.",
    "Another one, a little longer: the decode side must find all of its full pages there.",
]


@pytest.fixture(scope="module")
def single() -> Iterator:
    """The reference: one replica doing everything, no L3."""
    process = replica("--name", "single", *FLAGS).start()
    yield process
    process.stop()


# The redis variant starts its own replicas again (100 s of set-up on a loaded 2-core
# machine): the slow lane runs it.
@pytest.fixture(scope="module", params=["daemon", pytest.param("redis", marks=pytest.mark.slow)])
def shared_l3(request, tmp_path_factory) -> Iterator[tuple[str, str | None]]:
    """(L3 URL, the daemon's event endpoint or None)."""
    if request.param == "daemon":
        events = f"tcp://127.0.0.1:{free_port()}"
        daemon = DaemonProcess("--capacity", "64MiB", "--events-endpoint", events).start()
        yield f"grpc://{daemon.address}", events
        daemon.stop()
    else:
        server = RedisProcess(tmp_path_factory.mktemp("redis"), free_port()).start()
        yield f"{server.url}?prefix={uuid.uuid4().hex[:8]}:", None
        server.stop()


@pytest.fixture(scope="module")
def deployment(shared_l3) -> Iterator:
    l3_url, l3_events = shared_l3
    events = ("--events-endpoint", "tcp://127.0.0.1:0")
    prefill = replica("--name", "prefill", "--role", "prefill", "--l3-url", l3_url, *FLAGS, *events)
    decode = replica("--name", "decode", "--role", "decode", "--l3-url", l3_url, *FLAGS, *events)
    started = []
    try:
        for process in (prefill, decode):
            started.append(process.start())
        front = router(
            "--replica", prefill.url, "--replica", decode.url,
            *(("--l3-events", l3_events) if l3_events else ()),
        ).start()  # fmt: skip
        started.append(front)
        yield front
    finally:
        for process in reversed(started):
            process.stop()


def test_decode_output_equals_a_single_replica_and_computes_only_the_last_page(deployment, single):
    body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for prompt in PROMPTS:
        status, alone = post_json(f"{single.url}/v1/completions", {**body, "prompt": prompt})
        assert status == 200
        status, handed = post_json(f"{deployment.url}/v1/completions", {**body, "prompt": prompt})
        assert status == 200, handed
        stats = handed["hicache"]
        assert stats["replica"] == "decode"
        assert stats["token_ids"] == alone["hicache"]["token_ids"]  # token for token
        num_prompt = handed["usage"]["prompt_tokens"]
        full_pages = (num_prompt - 1) // PAGE
        assert full_pages >= 4
        assert stats["hit_tokens"]["l3"] == full_pages * PAGE  # every full page, from L3
        assert stats["computed_tokens"] == num_prompt - full_pages * PAGE <= PAGE
    routed = {
        r["name"]: r["routed"]
        for r in get_json(f"{deployment.url}/hicache/route/stats")["replicas"]
    }
    assert routed == {"prefill": len(PROMPTS), "decode": len(PROMPTS)}


def test_a_prompt_the_decode_side_can_already_find_skips_the_prefill(deployment):
    """The decode replica's index (its events, and the daemon's for L3) holds the whole
    prompt after one handoff: the router sends a repeat straight to it."""
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "prompt": PROMPTS[0] * 2}
    post_json(f"{deployment.url}/v1/completions", body)
    before = _routed(deployment.url)
    wait_events_applied(deployment.url)  # the decode replica's events reach the router
    status, again = post_json(f"{deployment.url}/v1/completions", body)
    assert status == 200
    after = _routed(deployment.url)
    assert after["prefill"] == before["prefill"] and after["decode"] == before["decode"] + 1
    assert again["hicache"]["route"]["cached_pages"][0] > 0  # its own L1


def _routed(url: str) -> dict[str, int]:
    return {r["name"]: r["routed"] for r in get_json(f"{url}/hicache/route/stats")["replicas"]}
