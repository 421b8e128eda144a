"""`hicache engine serve`'s settings: --no-cache, --device and --dtype are checked before
anything slow starts, and a mistake is one line naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_integration.serve.replica_config import ReplicaConfig
from tests.support.replicas import ROOT


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
    ],
)
def test_settings_a_replica_cannot_honour_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ReplicaConfig(**changes)


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
