"""Trace loading (Mooncake JSONL, with errors that name the line) and the generator."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from hicache.simulate.errors import TraceError
from hicache.simulate.trace import (
    ConversationWorkload,
    generate_conversations,
    load_mooncake,
    load_trace,
)


def write_lines(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def record(timestamp=0, input_length=600, hash_ids=(1, 2), **extra):
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": 5,
            "hash_ids": list(hash_ids),
            **extra,
        }
    )


def tokens(request):
    return np.frombuffer(request.token_bytes(), dtype="<u4")


def test_mooncake_blocks_expand_to_tokens_as_the_readme_says(tmp_path):
    path = write_lines(tmp_path, [record(1500, 600, (7, 3)), "", record(500, 512, (7,))])
    trace = load_mooncake(path)
    assert trace.block_size == 512
    assert [r.arrival_s for r in trace.requests] == [0.5, 1.5]  # ordered by timestamp
    first, second = (tokens(r) for r in trace.requests)
    assert len(first) == 512 and len(second) == 600
    assert first[0] == 7 * 512 and first[-1] == 7 * 512 + 511
    assert second[512] == 3 * 512 and second[-1] == 3 * 512 + 87  # last block cut to length
    assert np.array_equal(first, second[:512])  # equal block ids, equal tokens
    assert trace.total_tokens == 1112


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"timestamp": 0, "input_length": 5}), "missing field(s) hash_ids"),
        (record(timestamp=-1), "timestamp must be a number"),
        (record(timestamp="soon"), "timestamp must be a number"),
        (record(input_length=0, hash_ids=()), "input_length must be an integer >= 1"),
        (record(input_length=1.5), "input_length must be an integer"),
        (record(hash_ids=(1,)), "1 hash_ids for input_length 600"),
        (record(hash_ids=(1, "x")), "hash_ids must be a list of block ids"),
        (record(hash_ids=(1, -4)), "hash_ids must be a list of block ids"),
        (record(output_length=-3), "output_length must be an integer >= 0"),
    ],
)
def test_a_malformed_line_is_an_error_naming_its_line(tmp_path, bad, message):
    path = write_lines(tmp_path, [record(), record(10), bad, record(20)])
    with pytest.raises(TraceError) as error:
        load_mooncake(path)
    assert f"{path}:3:" in str(error.value)
    assert message in str(error.value)


def test_missing_and_empty_traces_are_errors(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        load_mooncake(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="holds no requests"):
        load_mooncake(write_lines(tmp_path, [""]))


def test_limit_reads_only_the_first_requests(tmp_path):
    path = write_lines(tmp_path, [record(i) for i in range(10)])
    assert load_trace(str(path), limit=3).num_requests == 3


def small_workload(**changes):
    values = dict(
        sessions=30,
        system_prompts=3,
        system_tokens=40,
        user_tokens=10,
        output_tokens=8,
        turns=3,
        think_s=5,
        rate=2,
        vocab=5000,
        seed=11,
    )
    return ConversationWorkload(**{**values, **changes})


def test_the_generator_is_seeded():
    one = generate_conversations(small_workload())
    two = generate_conversations(small_workload())
    other = generate_conversations(small_workload(seed=12))
    assert [r.arrival_s for r in one.requests] == [r.arrival_s for r in two.requests]
    assert all(
        a.token_bytes() == b.token_bytes() for a, b in zip(one.requests, two.requests, strict=True)
    )
    assert [r.token_bytes() for r in one.requests] != [r.token_bytes() for r in other.requests]


def test_generated_turns_extend_their_session_and_share_system_prompts():
    trace = generate_conversations(small_workload())
    by_session = {}
    for request in trace.requests:
        by_session.setdefault(request.session, []).append(request)
    assert len(by_session) == 30
    assert any(len(turns) > 1 for turns in by_session.values())
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            assert later.arrival_s >= earlier.arrival_s
            assert later.input_length > earlier.input_length
            assert later.token_bytes().startswith(earlier.token_bytes())
    openings = {turns[0].token_bytes()[: 4 * 20] for turns in by_session.values()}
    assert len(openings) <= 3  # every session opens with one of three system prompts
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)


def test_workload_specs_parse_and_reject_nonsense():
    trace = load_trace("conversations:sessions=5,seed=3,turns=2")
    assert len({r.session for r in trace.requests}) == 5
    with pytest.raises(ValueError, match="use name=value"):
        ConversationWorkload.from_spec("sessions")
    with pytest.raises(ValueError, match="use name=value"):
        ConversationWorkload.from_spec("colour=blue")
    with pytest.raises(ValueError, match="sessions must be an integer"):
        ConversationWorkload.from_spec("sessions=many")
    with pytest.raises(ValueError, match="out of range: rate=0"):
        ConversationWorkload.from_spec("rate=0")


def test_the_bundled_trace_is_the_published_one(mooncake):
    assert len(mooncake.requests) == 3993
    assert sum(request.input_length for request in mooncake.requests) == 61_194_628


def test_gzip_traces_read_like_plain_ones(tmp_path):
    import gzip

    lines = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    plain = tmp_path / "t.jsonl"
    plain.write_text(lines + "not json\n")
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write(lines + "not json\n")
    for path in (plain, packed):
        with pytest.raises(TraceError, match=rf"{path.name}:2"):
            load_mooncake(path)
    assert load_mooncake(packed, limit=1).requests[0].input_length == 600
