"""The OpenAI request fields `hicache engine serve` (and the router's edge) takes: a field
that would change the tokens or how they are cached, and that the engine does not honour, is
refused by name, never served as if it had been honoured."""

from __future__ import annotations

import pytest

from engine_integration.serve.openai_api import CHAT, COMPLETIONS, BadRequest, check_fields

PROMPT = {"prompt": "x", "max_tokens": 2}


@pytest.mark.parametrize(
    "name, value",
    [
        ("cache_salt", "tenant-a"),  # vLLM's per-request cache isolation: one namespace here
        ("min_p", 0.1),
        ("repetition_penalty", 1.2),
        ("min_tokens", 8),
        ("stop_token_ids", [7]),
        ("guided_json", {"type": "object"}),
        ("prompt_logprobs", 1),
    ],
)
def test_a_field_the_engine_does_not_honour_is_refused_by_name(name, value):
    with pytest.raises(BadRequest, match=f"^'{name}' is not supported by hicache engine serve$"):
        check_fields(COMPLETIONS, {**PROMPT, name: value})


@pytest.mark.parametrize("value", ["false", 0, 1, None, []])
def test_ignore_eos_must_be_true_or_false(value):
    with pytest.raises(BadRequest, match="^'ignore_eos' must be true or false$"):
        check_fields(COMPLETIONS, {**PROMPT, "ignore_eos": value})


def test_the_fields_served_and_openais_bookkeeping_pass():
    sampling, stream = check_fields(
        COMPLETIONS,
        {
            **PROMPT,
            "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "ignore_eos": True,
            "stream": True, "model": "m", "user": "u", "stream_options": {"include_usage": True},
            "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "stop": None,
        },
    )  # fmt: skip
    assert stream and sampling.ignore_eos and sampling.top_k == 4 and sampling.seed == 3
    messages = [{"role": "user", "content": "hi"}]
    sampling, _ = check_fields(CHAT, {"messages": messages, "max_completion_tokens": 3})
    assert sampling.max_new_tokens == 3


def test_a_prompt_field_on_the_other_endpoint_is_refused():
    with pytest.raises(BadRequest, match="^'prompt' is not supported by hicache engine serve"):
        check_fields(CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt": "x"})
    with pytest.raises(BadRequest, match="^'messages' is not supported by hicache engine serve"):
        check_fields(COMPLETIONS, {**PROMPT, "messages": []})


def test_an_error_shows_a_long_or_odd_name_or_value_cut_on_one_line():
    with pytest.raises(BadRequest) as refused:
        check_fields(COMPLETIONS, {**PROMPT, "a\nb" * 10_000: 1})
    message = str(refused.value)
    assert "\n" not in message and len(message) < 120 and message.startswith("'a\\nb")
    with pytest.raises(BadRequest) as refused:
        check_fields(COMPLETIONS, {**PROMPT, "temperature": "9" * 100_000})
    assert len(str(refused.value)) < 160
