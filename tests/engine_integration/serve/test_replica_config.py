"""`hicache engine serve`'s settings: --no-cache, --device, --dtype and --l3-fetch are checked
before anything slow starts, and a mistake is one line naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_integration.engine.model.config import (
    RopeScaling,
    model_config_from_json,
    model_config_to_json,
    tiny_model_config,
)
from engine_integration.serve.replica_config import ReplicaConfig, fetch_policies
from hicache.config import PolicyConfig
from tests.support.replicas import ROOT, get_json, post_stream, replica


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"cache": False, "l2_pages": 8}, "--no-cache leaves no cache for --l2-pages"),
        (
            {"cache": False, "events_endpoint": "tcp://127.0.0.1:0"},
            "--no-cache leaves no cache for --events-endpoint",
        ),
        ({"device": "tpu"}, "--device must be 'cpu' or 'cuda[:N]'"),
        ({"dtype": "int8"}, "--dtype must be one of float32, bfloat16, float16"),
        (
            {"l3_fetch": "sometimes", "l3_url": "file:///l3", "l2_pages": 8},
            "--l3-fetch must be one of measured, always, got 'sometimes'",
        ),
        ({"l3_fetch": "always"}, "--l3-fetch says how to read L3: give --l3-url"),
        (
            {"role": "decode", "l3_url": "file:///l3", "l2_pages": 8, "l3_fetch": "measured"},
            "--role decode fetches a handed-off prompt whole",
        ),
    ],
)
def test_settings_a_replica_cannot_honour_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ReplicaConfig(**changes)


@pytest.mark.parametrize(
    "role, l3_fetch, policies",
    [
        ("both", None, ("measured", "timeout")),
        ("prefill", None, ("measured", "timeout")),
        ("decode", None, ("always", "wait_complete")),
        ("both", "always", ("always", "wait_complete")),
        ("decode", "always", ("always", "wait_complete")),
        ("both", "measured", ("measured", "timeout")),
    ],
)
def test_a_replica_reads_l3_by_its_role_unless_told(role, l3_fetch, policies):
    fields = fetch_policies(role, l3_fetch)
    assert (fields["l3_fetch_policy"], fields["prefetch_policy"]) == policies
    assert PolicyConfig(**fields).l3_fetch_policy == policies[0]  # names it takes
    ReplicaConfig(role=role, l3_url="file:///l3", l2_pages=8, l3_fetch=l3_fetch)


def test_no_cache_and_cuda_settings_are_accepted():
    config = ReplicaConfig(cache=False, l1_pages=32, device="cuda:1", dtype="bfloat16")
    assert not config.cache and config.device == "cuda:1" and config.dtype == "bfloat16"


def test_the_command_refuses_no_cache_with_an_l2_before_loading_a_model():
    result = subprocess.run(
        [sys.executable, "-m", "hicache", "engine", "serve", "--no-cache", "--l2-pages", "8"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hicache engine serve: error: --no-cache leaves no cache for --l2-pages"
    ]


def test_a_model_config_round_trips_through_json_and_unknown_fields_are_refused():
    config = tiny_model_config(3).replace(
        num_source_layers=6,
        windowed_layers=(0, 2),
        rope_scaling=RopeScaling("linear", 2.0),
        model_id="synthetic",
    )
    assert model_config_from_json(model_config_to_json(config)) == config
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        model_config_from_json('{"vocab_size": 8, "sliding": 4}')
    with pytest.raises(ValueError, match="hidden_size"):
        model_config_from_json('{"vocab_size": 8}')  # the rest of the shape missing
    bad_heads = json.loads(model_config_to_json(config)) | {"num_kv_heads": 3}
    with pytest.raises(ValueError, match="num_heads"):
        model_config_from_json(json.dumps(bad_heads))
    with pytest.raises(ValueError, match="not JSON"):
        model_config_from_json("{vocab_size: 8}")


def test_the_command_names_a_bad_model_config(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"vocab_size": 300, "shape": 1}')
    result = subprocess.run(
        [sys.executable, "-m", "hicache", "engine", "serve", "--model-config", str(path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"hicache engine serve: error: --model-config {path}: unknown ModelConfig field(s) shape"
    )
    with pytest.raises(ValueError, match="give --model or --model-config, not both"):
        ReplicaConfig(model_path="m.gguf", model_config=tiny_model_config())


def test_a_replica_serves_a_synthetic_model_of_the_given_shape(tmp_path):
    config = tiny_model_config().replace(num_layers=3, num_source_layers=2, model_id="shape-3")
    path = tmp_path / "model.json"
    path.write_text(model_config_to_json(config))
    process = replica("--model-config", str(path), "--page-size", "16", "--l1-pages", "32")
    process.start()
    try:
        assert get_json(f"{process.url}/hicache/info")["model"] == "shape-3"
        events = post_stream(
            f"{process.url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}
        )
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    finally:
        process.stop()
