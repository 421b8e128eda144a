"""`hicache simulate` from the command line: text, --json, --sweep files, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.simulate.sweep import parse_sweep
from tests.support.cli import ROOT

SMALL = "conversations:sessions=40,turns=3,rate=2,seed=2"


def run_cli(capsys, *args):
    code = main(["simulate", "--trace", SMALL, "--no-progress", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_documented_fields(capsys):
    code, out, _ = run_cli(
        capsys, "--json", "--no-verdict", "--l1", "5", "--l2", "20", "--l3", "100"
    )
    assert code == 0
    (line,) = out.strip().splitlines()
    result = json.loads(line)
    for key in ("requests", "total_tokens", "hit_tokens", "hit_rate", "elapsed_s"):
        assert key in result
    tiers = [result[tier]["hit_tokens"] for tier in ("l1", "l2", "l3")]
    assert sum(tiers) == result["hit_tokens"] > 0
    assert result["hit_rate"] == pytest.approx(
        result["hit_tokens"] / result["total_tokens"], abs=1e-6
    )
    assert result["config"]["l3_gb"] == 100
    assert result["verdict"] is None
    assert result["ttft_s"]["p50"] <= result["ttft_s"]["p90"] <= result["ttft_s"]["p99"]


def test_text_report_with_its_verdict(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "llama-3.1-8b", "--hardware", "b200", "--l2", "50", "--jobs", "1"
    )
    assert code == 0
    assert "llama-3.1-8b" in out and "B200" in out
    assert "hit rate" in out and "TTFT" in out and "cost per month" in out
    assert "verdict:" in out
    assert "Reuse ceiling" in out and "Next dollar" in out
    assert "Prefill/decode disaggregation with a shared L3" in out


def test_a_sweep_writes_a_table_json_and_plots(capsys, tmp_path):
    out_dir = tmp_path / "sweep"
    code, out, _ = run_cli(
        capsys,
        "--sweep",
        "l2=0,10,100",
        "--l1",
        "2",
        "--out",
        str(out_dir),
        "--no-verdict",
        "--jobs",
        "2",
    )
    assert code == 0
    assert "| L2 GB | hit %" in out and "Best point of the sweep" in out
    document = json.loads((out_dir / "sweep.json").read_text())
    rates = [point["hit_rate"] for point in document["points"]]
    assert [point["l2_gb"] for point in document["points"]] == [0, 10, 100]
    assert rates == sorted(rates) and rates[-1] > rates[0]
    assert (out_dir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| L2 GB |" in (out_dir / "sweep.md").read_text()


def test_a_two_axis_sweep_is_a_grid(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys,
        "--sweep",
        "l1=1,4",
        "--sweep",
        "l2=0:40:3",
        "--out",
        str(tmp_path),
        "--no-verdict",
        "--json",
        "--jobs",
        "1",
    )
    assert code == 0
    points = json.loads(out)["points"]
    assert [(p["l1_gb"], p["l2_gb"]) for p in points] == [
        (1, 0),
        (1, 20),
        (1, 40),
        (4, 0),
        (4, 20),
        (4, 40),
    ]


def test_a_malformed_trace_fails_with_its_line_number(capsys, tmp_path):
    trace = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    trace.write_text(good + "\n" + '{"timestamp": 5, "input_length": 10}\n')
    code = main(["simulate", "--trace", str(trace), "--no-progress"])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"{trace}:2: missing field(s) hash_ids" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sweep", "l4=1,2"], "expected l1=..., l2=... or l3=..."),
        (["--sweep", "l2=1:2:1"], "a range needs a count >= 2"),
        (["--model", "no-such-model"], "unknown model"),
        (["--l2", "0", "--l3", "10"], "an L3 needs an L2"),
        (["--mtp", "--model", "llama-3.1-8b"], "has no MTP layers"),
    ],
)
def test_bad_arguments_are_clear_errors(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err


def test_sweep_specs():
    assert parse_sweep("l3=0.5TB,2TB").values_bytes == (0.5e12, 2e12)
    geometric = parse_sweep("l2=10..1000:3").values_bytes
    assert geometric == pytest.approx((10e9, 100e9, 1000e9))
    with pytest.raises(ValueError, match="starts above 0"):
        parse_sweep("l2=0..1000:3")


def test_the_simulator_runs_without_torch():
    code = (
        "import sys\n"
        "from hicache.cli import main\n"
        f"main(['simulate', '--trace', '{SMALL}', '--json', '--no-progress', '--jobs', '1'])\n"
        "import hicache.simulate.plots, hicache.simulate.cli\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["requests"] > 0


def test_the_saved_figure_says_what_it_is_computed_from_and_adds_up(capsys):
    code, out, _ = run_cli(capsys, "--json", "--no-verdict", "--l1", "5", "--l2", "20")
    result = json.loads(out)
    prefill, price = result["prefill"], result["config"]["gpu_hour_price"]
    gpus_saved = prefill["gpus_busy_without_cache"] - prefill["gpus_busy"]
    assert result["saved_per_month"] == pytest.approx(gpus_saved * 730 * price, rel=1e-2)
    assert gpus_saved > 0
    code, out, _ = run_cli(capsys, "--no-verdict", "--l1", "5", "--l2", "20")
    (line,) = [line for line in out.splitlines() if line.startswith("saved $/month:")]
    assert "GPU-hours in this run's" in line and "730 h" in line and "are deployed" in line
    (timing,) = [line for line in out.splitlines() if line.startswith("simulated in")]
    assert " s on " in timing and " CPUs" in timing and "load" in timing


def test_a_saving_above_the_gpu_bill_is_explained(capsys):
    from hicache.cli import build_parser
    from hicache.simulate.flag_config import build_config
    from hicache.simulate.player import TracePlayer
    from hicache.simulate.report import savings_basis
    from hicache.simulate.trace import load_trace

    trace = load_trace(SMALL)
    config = build_config(build_parser().parse_args(["simulate", "--l1", "5", "--l2", "20"]), trace)
    result = TracePlayer(config, trace).run()
    assert "could not keep up" not in savings_basis(result, config)
    # The same saving over a span so short that uncached prefill needs more GPUs than exist.
    squeezed = dataclasses.replace(result, duration_s=result.duration_s / 1000)
    assert squeezed.prefill_gpus_busy_without_cache > config.gpus_per_instance
    assert "could not keep up" in savings_basis(squeezed, config)
    assert "exceed their bill" in savings_basis(squeezed, config)


def test_the_sweep_plot_shows_the_ceiling_the_recommended_point_and_net(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    from hicache.simulate.plots import plot_sweep

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [
        {"l2_gb": gb, "hit_rate": hit, "l1_hit_rate": 0.3, "l2_hit_rate": hit - 0.3,
         "l3_hit_rate": 0.0, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "ttft_p99_s": 3.0,
         "cache_cost_per_month": cost, "saved_per_month": saved, "net_per_month": saved - cost}
        for gb, hit, cost, saved in ((0, 0.3, 100, 500), (10, 0.5, 200, 900), (20, 0.55, 600, 950))
    ]  # fmt: skip
    plot_sweep([parse_sweep("l2=0,10,20")], rows, tmp_path / "s.png", "t", ceiling_hit_rate=0.6)
    hits, _, money = figures[0].axes
    flat = [line.get_ydata() for line in hits.get_lines()]
    assert any(len(set(y)) == 1 and y[0] == pytest.approx(60) for y in flat)  # the ceiling
    (net,) = [line for line in money.get_lines() if line.get_label().startswith("net")]
    assert list(net.get_ydata()) == [400, 700, 350]
    best = [c for c in money.collections if c.get_label().startswith("recommended: L2 10 GB")]
    assert best and list(best[0].get_offsets()[0]) == [10, 700]
    labels = [t.get_text() for panel in figures[0].axes for t in panel.texts]
    assert len(labels) == len(set(labels))  # no point labels piled on each other


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_ctrl_c_during_a_sweep_is_one_line_exit_130_and_ends_the_workers():
    """Ctrl-C reaches the whole process group (the sweep's workers too): the command says
    so in one line, no worker prints a traceback, and none is left running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache", "simulate", "--trace",
         "conversations:sessions=400,turns=3,seed=2", "--sweep", "l2=1,2,4,8,16,32",
         "--jobs", "2", "--no-progress", "--no-verdict"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    while len(_children(proc.pid)) < 2 and proc.poll() is None:  # the sweep's pool is up
        threading.Event().wait(0.05)  # polling a condition, not waiting for time
    workers = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["hicache simulate: stopped by SIGINT (exit 130)"]
    assert workers and not any(Path(f"/proc/{pid}/cmdline").exists() for pid in workers)


def test_an_l3_store_preset_sets_bandwidth_and_latency_unless_flags_do():
    import argparse

    from hicache.simulate.flag_config import build_config
    from hicache.simulate.flags import add_arguments
    from hicache.simulate.l3 import STORE_PRESETS
    from hicache.simulate.trace import load_trace

    for preset in STORE_PRESETS.values():
        assert 0 < preset.latency_s < 0.01 and preset.bandwidth_bytes_per_s > 1e8
        assert "bench_backends.py --backends mooncake" in preset.measured
    server = STORE_PRESETS["mooncake-tcp-gpu-host"]  # a server moves more than a 2-core VM
    assert server.bandwidth_bytes_per_s > STORE_PRESETS["mooncake-tcp"].bandwidth_bytes_per_s
    preset = STORE_PRESETS["mooncake-tcp"]
    trace = load_trace(SMALL)

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def config(*flags):
        return build_config(parser.parse_args(["--trace", SMALL, "--l3", "100", *flags]), trace)

    plain = config()
    assert plain.l3_bandwidth_bytes_per_s is None and plain.l3_latency_s == 100e-6
    store = config("--l3-store", "mooncake-tcp")
    assert store.l3_bandwidth_bytes_per_s == preset.bandwidth_bytes_per_s
    assert store.l3_latency_s == preset.latency_s
    overridden = config("--l3-store", "mooncake-tcp", "--l3-bandwidth", "5", "--l3-latency-us", "7")
    assert overridden.l3_bandwidth_bytes_per_s == 5e9 and overridden.l3_latency_s == 7e-6
