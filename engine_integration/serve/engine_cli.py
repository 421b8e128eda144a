"""`hicache engine serve`: the command line of one engine replica (`replica.py`).

Torch-free: `hicache --help` imports every subcommand's parser; the replica's module, which
loads the model, is imported only to run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from engine_integration.serve.replica_config import DTYPES, L3_FETCHES, ROLES, ReplicaConfig

# The one line `hicache --help` shows for this subcommand.
HELP = "serve the embedded engine over HTTP, OpenAI-compatible (`hicache engine serve`)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="engine_command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve the embedded engine over HTTP (OpenAI-compatible), with hicache under it",
        description="One embedded-engine replica behind /v1/completions and "
        "/v1/chat/completions; `hicache route` puts several behind one address.",
    )
    serve.set_defaults(_parser=serve)  # its mistakes and signals are `hicache engine serve`'s
    a = serve.add_argument
    a(
        "--model",
        default=None,
        metavar="MODEL",
        help="smollm2 or gemma3 (their packages), a .gguf file or a Hugging Face model "
        "directory (default: the built-in tiny model, random weights from --seed)",
    )
    a(
        "--model-config",
        default=None,
        metavar="FILE",
        help="instead: a synthetic model, a JSON object of ModelConfig's fields (random "
        "weights from --seed)",
    )
    a("--seed", type=int, default=0, help="the built-in model's weights (default: %(default)s)")
    a("--name", default="", help="this replica's name in responses and logs (default: by pid)")
    a(
        "--role",
        choices=ROLES,
        default="both",
        help="both: serve requests whole; prefill / decode: the two sides of a P/D deployment, "
        "handing prompts over through the shared L3 (needs --l3-url) (default: %(default)s)",
    )
    a("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    a("--port", type=int, default=8100, help="HTTP port; 0 picks a free one (default: %(default)s)")
    a("--page-size", type=int, default=64, help="tokens per KV page (default: %(default)s)")
    a(
        "--max-running",
        type=int,
        default=8,
        help="requests the engine runs at once (default: %(default)s)",
    )
    a("--l1-pages", type=int, default=512, help="L1 pool pages (default: %(default)s)")
    a("--l2-pages", type=int, default=0, help="L2 host pool pages; 0: no L2 (default: %(default)s)")
    a(
        "--l3-url",
        default=None,
        help="the shared L3: grpc://HOST:PORT (hicache serve), redis://HOST:PORT/0, "
        "mooncake://MASTER:PORT, file:///DIR",
    )
    a(
        "--l3-fetch",
        choices=L3_FETCHES,
        default=None,
        help="how a run found in L3 is read: measured fetches what beats recomputing it, by "
        "the rates this replica measures; always fetches all of it and waits for it "
        "(default: always for --role decode, else measured)",
    )
    a(
        "--events-endpoint",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="publish KV events (vLLM's format, per tier) on this ZMQ PUB address, e.g. "
        "tcp://127.0.0.1:5557; port 0 picks a free one (default: none)",
    )
    a(
        "--events-replay-endpoint",
        default=None,
        metavar="ZMQ_ADDRESS",
        help="serve replays of recent event batches on this ZMQ ROUTER address (default: none)",
    )
    a(
        "--events-topic",
        default=None,
        help="the first frame of every event message (default: kv@<host>@<model>, llm-d's)",
    )
    a(
        "--events-format",
        default="vllm",
        choices=("vllm", "sglang"),
        help="the events' schema: vLLM's or SGLang's (int64 hashes, its media names) "
        "(default: %(default)s)",
    )
    a("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: %(default)s)")
    a(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the model's and the KV's dtype (default: float32 on the CPU, bfloat16 on CUDA)",
    )
    a(
        "--no-cache",
        action="store_true",
        help="serve without hicache (every prompt computed whole): the baseline a cache is "
        "measured against; --l1-pages then sizes the engine's own KV pages",
    )
    a(
        "--deterministic",
        action="store_true",
        help="CUDA: batch-invariant kernels, so a prefix hit never changes a logit's bits "
        "(EngineConfig.deterministic)",
    )
    a(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads; 0: torch's default (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    if args.engine_command != "serve":
        print("hicache engine: give a command: serve", file=sys.stderr)
        return 2
    from engine_integration.engine.packaged import check_named, resolve

    try:
        check_named(args.model)
        config = ReplicaConfig(
            model_path=args.model,
            model_config=_model_config(args.model_config),
            seed=args.seed,
            name=args.name,
            role=args.role,
            host=args.host,
            port=args.port,
            page_size=args.page_size,
            max_running_requests=args.max_running,
            l1_pages=args.l1_pages,
            l2_pages=args.l2_pages,
            l3_url=args.l3_url,
            events_endpoint=args.events_endpoint,
            events_replay_endpoint=args.events_replay_endpoint,
            events_topic=args.events_topic,
            events_format=args.events_format,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            cache=not args.no_cache,
            deterministic=args.deterministic,
            l3_fetch=args.l3_fetch,
        )
    except ValueError as error:
        print(f"hicache engine serve: error: {error}", file=sys.stderr)
        return 2
    from engine_integration.serve.openai_api import listen_for

    sock = listen_for("hicache engine serve", config.host, config.port)  # before the model
    if sock is None:
        return 2
    with sock:
        from engine_integration.serve.replica import serve  # torch enters here

        config = dataclasses.replace(config, model_path=resolve(args.model))
        return asyncio.run(serve(config, sock))


def _model_config(path: str | None):
    """--model-config's file read and checked (ValueError naming the flag)."""
    if path is None:
        return None
    from engine_integration.engine.model.config import model_config_from_json

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1 << 20)
    except OSError as error:
        raise ValueError(f"--model-config {path}: {error.strerror or error}") from None
    try:
        return model_config_from_json(text)
    except ValueError as error:
        raise ValueError(f"--model-config {path}: {error}") from None
