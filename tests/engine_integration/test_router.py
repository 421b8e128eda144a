"""`hicache route` over real `hicache engine serve` replicas on loopback (the built-in tiny
model, fp32 on the CPU): prefix routing against round robin on a multi-turn workload, a
replica killed mid-run, and the OpenAI endpoints through the router (streamed and not)."""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter

import pytest

from tests.support.replicas import get_json, post_json, post_stream, replica, router

PAGE = 16
REPLICA_FLAGS = (
    "--page-size", str(PAGE), "--l1-pages", "256", "--max-running", "4",
    "--events-endpoint", "tcp://127.0.0.1:0", "--events-replay-endpoint", "tcp://127.0.0.1:0",
)  # fmt: skip


@pytest.fixture(scope="module")
def replicas():
    started = []
    try:
        for i in range(3):
            started.append(replica("--name", f"r{i}", *REPLICA_FLAGS))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: p.start(), started))
        yield started
    finally:
        for process in started:
            process.stop()


@pytest.fixture
def routers(replicas):
    made = []

    def make(*flags: str):
        process = router(*(f for r in replicas for f in ("--replica", r.url)), *flags).start()
        made.append(process)
        return process

    yield make
    for process in made:
        process.stop()


def run_conversations(url: str, tag: str, num_users: int = 6, num_turns: int = 4):
    """Users chatting at once, each turn after the previous one's answer, a wave at a time.
    Returns the responses per user, in turn order."""
    system = f"[{tag}] Be brief."
    histories = [[{"role": "system", "content": system}] for _ in range(num_users)]
    answers: list[list[dict]] = [[] for _ in range(num_users)]

    def turn(user: int, t: int) -> None:
        question = f"User {user} asks question number {t}: what about topic {user * 7 + t}?"
        histories[user].append({"role": "user", "content": question})
        status, body = post_json(
            f"{url}/v1/chat/completions",
            {"messages": histories[user], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        answers[user].append(body)
        histories[user].append(
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
        )

    with concurrent.futures.ThreadPoolExecutor(num_users) as pool:
        for t in range(num_turns):
            list(pool.map(turn, range(num_users), [t] * num_users))
            time.sleep(0.3)  # the last answers' KV events reach the router
    return answers


def hit_rate(answers) -> float:
    flat = [a for user in answers for a in user]
    hits = sum(sum(a["hicache"]["hit_tokens"].values()) for a in flat)
    return hits / sum(a["usage"]["prompt_tokens"] for a in flat)


def load(answers) -> Counter:
    return Counter(a["hicache"]["replica"] for user in answers for a in user)


def test_prefix_routing_keeps_each_conversation_on_its_replica_and_the_load_even(routers):
    by_prefix = routers("--policy", "prefix")
    by_turn = routers("--policy", "round_robin")
    prefix_answers = run_conversations(by_prefix.url, "prefix")
    turn_answers = run_conversations(by_turn.url, "round_robin")
    for user in prefix_answers:
        homes = {a["hicache"]["replica"] for a in user}
        assert len(homes) == 1, f"a conversation moved between replicas: {homes}"
        for later in user[1:]:  # each later turn found its whole history but the last page
            route = later["hicache"]["route"]
            assert route["cached_pages"][0] > 0 and later["hicache"]["hit_tokens"]["l1"] > 0
    prefix_load, turn_load = load(prefix_answers), load(turn_answers)
    assert sorted(prefix_load.values()) == [8, 8, 8], prefix_load
    assert sorted(turn_load.values()) == [8, 8, 8], turn_load
    assert hit_rate(prefix_answers) >= 1.5 * hit_rate(turn_answers), (
        hit_rate(prefix_answers),
        hit_rate(turn_answers),
    )
    stats = get_json(f"{by_prefix.url}/hicache/route/stats")
    assert all(r["pages"]["l1"] > 0 for r in stats["replicas"])  # every replica's events


def test_the_router_streams_what_the_replica_computes(routers):
    front = routers()
    body = {"prompt": "Streaming through the router, token by token.", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, whole = post_json(f"{front.url}/v1/completions", body)
    assert status == 200
    events = post_stream(f"{front.url}/v1/completions", body)
    assert events[-1] == "[DONE]"
    streamed = [t for e in events[:-2] for t in e["hicache"]["token_ids"]]
    assert streamed == whole["hicache"]["token_ids"] == events[-2]["hicache"]["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    status, refused = post_json(f"{front.url}/v1/completions", {**body, "n": 3})
    assert status == 400 and "'n'" in refused["error"]["message"]


def test_a_replica_killed_mid_run_loses_no_request_and_the_router_keeps_serving():
    # Its own replicas: this one is killed.
    victims = [replica("--name", f"k{i}", *REPLICA_FLAGS) for i in range(3)]
    front = None
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: p.start(), victims))
        front = router(
            *(f for r in victims for f in ("--replica", r.url)), "--policy", "least_load"
        ).start()
        body = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
        prompts = [f"Request {i}: a prompt long enough to fill a page or two." for i in range(9)]
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            futures = [
                pool.submit(post_json, f"{front.url}/v1/completions", {**body, "prompt": p})
                for p in prompts
            ]
            deadline = time.monotonic() + 60
            while not _in_flight(front.url, "k1"):
                assert time.monotonic() < deadline, "no request ever reached k1"
                time.sleep(0.02)
            victims[1].kill()
            results = [f.result() for f in futures]
        assert [status for status, _ in results] == [200] * 9  # nothing lost
        assert all(len(b["hicache"]["token_ids"]) == 48 for _, b in results)
        assert all(b["hicache"]["replica"] != "k1" for _, b in results)  # moved elsewhere
        stats = get_json(f"{front.url}/hicache/route/stats")
        dead = next(r for r in stats["replicas"] if r["name"] == "k1")
        assert not dead["alive"] and dead["failed"] >= 1
        status, after = post_json(f"{front.url}/v1/completions", {**body, "prompt": "still up?"})
        assert status == 200 and after["hicache"]["replica"] in ("k0", "k2")
    finally:
        if front is not None:
            front.stop()
        for process in victims:
            process.stop()


def _in_flight(url: str, name: str) -> bool:
    stats = get_json(f"{url}/hicache/route/stats", timeout_s=2)
    return bool(stats) and any(r["name"] == name and r["in_flight"] for r in stats["replicas"])
