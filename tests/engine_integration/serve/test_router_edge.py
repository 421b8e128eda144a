"""Bad requests at the router's edge: each is answered 400 with a one-line JSON error, and
none of them takes a replica out of the rotation, so good requests sent among them are all
served. Real replicas and a real router on loopback."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

from engine_integration.serve.openai_api import decode_body
from tests.support.replicas import get_json, replica, router

FLAGS = ("--page-size", "16", "--l1-pages", "256", "--max-running", "4")
GOOD = {"prompt": "Say hello.", "max_tokens": 4}
C, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = "a" * 8000  # past the replica's 256 pages of 16 tokens
BAD = {
    "lone surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "surrogate key": (C, b'{"prompt": "x", "\\udc80": 1}'),
    "not UTF-8": (C, b'{"prompt": "\xff\xfe"}'),
    "deep nesting": (C, b"[" * 100_000 + b"]" * 100_000),
    "nested object": (C, b'{"prompt": "x", "user": ' + b'{"a": ' * 64 + b"1" + b"}" * 65),
    "2 MB prompt": (C, json.dumps({"prompt": "a" * 2_000_000}).encode()),
    "prompt too long": (C, json.dumps({"prompt": LONG, "max_tokens": 2}).encode()),
    "stream too long": (C, json.dumps({"prompt": LONG, "stream": True}).encode()),
    "not JSON": (C, b"{prompt: hello}"),
    "not an object": (C, b"[1, 2]"),
    "prompt a number": (C, b'{"prompt": 5}'),
    "messages a string": (CHAT, b'{"messages": "hi"}'),
    "max_tokens -1": (C, b'{"prompt": "x", "max_tokens": -1}'),
    "stream a string": (C, b'{"prompt": "x", "stream": "yes"}'),
    "ignore_eos a string": (C, b'{"prompt": "x", "ignore_eos": "false"}'),
    "cache_salt": (C, b'{"prompt": "x", "cache_salt": "tenant-a"}'),  # one namespace here
    "min_p": (C, b'{"prompt": "x", "min_p": 0.1}'),
}


def _post(url: str, raw: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def routed():
    started = [replica("--name", f"r{i}", *FLAGS) for i in range(2)]
    front = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(), started))
        front = router(*(f for r in started for f in ("--replica", r.url))).start()
        yield front, started
    finally:
        for process in ([front] if front else []) + started:
            process.stop()


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_request_is_a_400_with_a_one_line_json_error(routed, name):
    front, replicas = routed
    path, raw = BAD[name]
    for url in (front.url, replicas[0].url):  # the router's edge, and a replica's own
        status, answer = _post(url + path, raw)
        assert status == 400, (url, answer[:300])
        assert b"\n" not in answer.strip()
        assert decode_body(answer)["error"]["type"] == "invalid_request_error"


def test_bad_requests_among_good_ones_lose_no_good_request(routed):
    front, _ = routed
    bad = [BAD[name] for name in sorted(BAD)] * 3
    good = [json.dumps({**GOOD, "seed": i}).encode() for i in range(len(bad))]
    work = []
    for (path, raw), body in zip(bad, good, strict=True):
        work += [(path, raw, False), (C, body, True)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda w: (w[2], _post(front.url + w[0], w[1])), work))
    served = sum(ok and status == 200 for ok, (status, _) in answers)
    refused = sum(not ok and status == 400 for ok, (status, _) in answers)
    print(f"good requests served: {served}/{len(good)} ({100 * served / len(good):.1f} %)")
    assert (served, refused) == (len(good), len(bad))
    stats = get_json(front.url + "/hicache/route/stats")
    assert all(r["alive"] and r["failed"] == 0 for r in stats["replicas"]), stats
