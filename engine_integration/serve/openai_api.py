"""The OpenAI-compatible request and response shapes of `hicache engine serve` (and of the
router in front of it): `/v1/completions` and `/v1/chat/completions`, streamed or not.

`read_body` is the edge check every request passes first, at the router and at a replica:
a body of at most `MAX_BODY_BYTES`, strict UTF-8, JSON nested at most `MAX_JSON_DEPTH`
deep, no lone surrogate in any string (JSON's `"\ud800"` escape is not text). What fails it
is a `BadRequest`: HTTP 400 with a one-line JSON error, never a 500.

`parse_request` turns a request body into a prompt's token ids and sampling parameters,
refusing, by name, a field we cannot honour (`n` > 1, `stop` strings, `logprobs`): a client
must never get a different computation than the one it asked for. The chunk and response
builders write what OpenAI's clients read, plus a `hicache` object (token ids, where the
prompt's KV came from, which replica served it). Torch-free.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine_integration.serve.workload import render_chat
from hicache.cli import say

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# The fields each endpoint takes: those served (the prompt, the sampling fields, `stream`),
# and OpenAI's bookkeeping, accepted and ignored (it changes no token). Any other field is
# refused by name: one that changes the tokens or how they are cached (`min_p`,
# `cache_salt`, ...) is never served as if it had been honoured.
_SERVED = {
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stream",
    "ignore_eos",
}  # fmt: skip
_IGNORED = {"model", "user", "stream_options"}
_UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "stop": lambda v: v not in (None, [], ""),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: v not in (None, ""),
    "logit_bias": lambda v: v not in (None, {}),
    "tools": lambda v: v not in (None, []),
    "response_format": lambda v: v is not None,
}
_PENALTIES = ("presence_penalty", "frequency_penalty")
_TAKEN = _SERVED | _IGNORED | _UNSUPPORTED.keys() | set(_PENALTIES)
_FIELDS = {COMPLETIONS: _TAKEN | {"prompt"}, CHAT: _TAKEN | {"messages"}}


MAX_BODY_BYTES = 1 << 20  # a request body; a longer prompt is sent as token ids or not at all
MAX_JSON_DEPTH = 32  # objects and arrays within each other


class BadRequest(ValueError):
    """A request body we cannot serve; the message names the field (HTTP 400)."""


def bad_request(error: BadRequest) -> web.Response:
    return web.json_response(error_body(str(error)), status=400)


async def read_body(request: web.Request) -> Any:
    """The request's JSON body, checked as the module doc says; raises BadRequest."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BadRequest(
            f"the request body is {request.content_length} bytes; at most {MAX_BODY_BYTES}"
        )
    raw = bytearray()
    async for data in request.content.iter_chunked(64 << 10):
        raw += data
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over {MAX_BODY_BYTES} bytes")
    return decode_body(bytes(raw))


def decode_body(raw: bytes) -> Any:
    """`read_body` of bytes already read."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"the request body is not UTF-8 (byte {error.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadRequest(f"the request body is not JSON ({error})") from None
    except RecursionError:  # the parser's own bound, far past ours
        raise BadRequest(_too_deep()) from None
    _check_text(body)
    return body


def _too_deep() -> str:
    return f"the request body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"


def _check_text(body: Any) -> None:
    """Nesting at most MAX_JSON_DEPTH deep; every string (keys too) Unicode text (a lone
    surrogate is not)."""
    stack = [(body, "the body", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(_too_deep())
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise BadRequest(
                    f"{path} holds a lone surrogate ({item[error.start]!a}), not text"
                ) from None
        elif isinstance(item, dict):
            for key, inner in item.items():
                stack.append((key, f"a key of {path}", depth))
                stack.append((inner, f"{key!a}", depth + 1))
        elif isinstance(item, list):
            stack.extend((inner, f"{path}[{i}]", depth + 1) for i, inner in enumerate(item))


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a request, checked (engine_integration.engine.sampling takes them)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class ApiRequest:
    path: str  # COMPLETIONS or CHAT
    prompt_ids: list[int]
    sampling: Sampling
    stream: bool
    model: str
    request_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")


def check_fields(path: str, body: Any) -> tuple[Sampling, bool]:
    """Everything about a request that needs no tokenizer (the router checks this much at
    its edge): its shape, the fields we cannot honour, the sampling fields and `stream`.
    Raises BadRequest naming what is wrong."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    if path not in _FIELDS:
        raise BadRequest(f"unknown endpoint {path}")
    for name in body:
        if name not in _FIELDS[path]:
            raise BadRequest(f"{_shown(name)} is not supported by hicache engine serve")
    for name, refused in _UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise BadRequest(f"'{name}' is not supported by hicache engine serve")
    for name in _PENALTIES:
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(f"'{name}' is not supported by hicache engine serve")
    if path == COMPLETIONS:
        _completion_prompt(body.get("prompt"))
    else:
        _chat_messages(body.get("messages"))
    default_max = 16
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
    sampling = Sampling(
        max_new_tokens=_int(max_tokens, "max_tokens", low=1, high=1 << 20),
        temperature=_number(body.get("temperature", 1.0), "temperature", low=0.0, high=100.0),
        top_p=_number(body.get("top_p", 1.0), "top_p", low=1e-9, high=1.0),
        top_k=_int(body.get("top_k", 0), "top_k", low=0, high=1 << 31),
        seed=_int(body.get("seed", 0), "seed", low=0, high=(1 << 63) - 1),
        ignore_eos=body.get("ignore_eos", False),
    )
    if not isinstance(sampling.ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be true or false")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    if not isinstance(body.get("model", ""), str):
        raise BadRequest("'model' must be a string")
    return sampling, stream


def parse_request(path: str, body: Any, tokenizer, model_name: str) -> ApiRequest:
    """The request `body` (decoded JSON) sent to `path`; raises BadRequest naming what is
    wrong. A completions `prompt` may be text or a list of token ids."""
    sampling, stream = check_fields(path, body)
    if path == COMPLETIONS:
        prompt = _completion_prompt(body.get("prompt"))
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    else:
        messages = [dict(m) for m in body["messages"]]
        # One renderer for the whole service: the demo's (the chat template if the model has
        # one, else a plain "User: / Assistant:" format).
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text)
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise BadRequest(f"'prompt' holds token ids outside the vocabulary [0, {vocab})")
    return ApiRequest(path, prompt_ids, sampling, stream, str(body.get("model") or model_name))


def _completion_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids")


def _chat_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or message.get("role") not in ("system", "user", "assistant")
            or not isinstance(message.get("content"), str)
        ):
            raise BadRequest(
                f"'messages'[{i}] must be {{'role': system|user|assistant, 'content': str}}"
            )
    if messages[-1]["role"] == "assistant":
        raise BadRequest("the last of 'messages' must not be the assistant's")


def _int(value: Any, name: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}], got {_shown(value)}")
    return value


def _number(value: Any, name: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}], got {_shown(value)}")
    return float(value)


def _shown(value: Any, limit: int = 64) -> str:
    """`value` as an error message shows it: its repr (quoted, escaped: one line), cut at
    `limit` characters (a name or value from a client can be as long as the body)."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# ---------------------------------------------------------------------------- responses


def chunk(request: ApiRequest, text: str, finish_reason: str | None, extra=None) -> dict:
    """One streamed chunk (`data: <json>`)."""
    if request.path == CHAT:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    body = {
        "id": request.request_id,
        "object": kind,
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
    }
    if extra:
        body.update(extra)
    return body


def response(request: ApiRequest, text: str, finish_reason: str, extra: dict) -> dict:
    """The whole (non-streamed) response."""
    if request.path == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {
        "id": request.request_id,
        "object": kind,
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        **extra,
    }


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


class TextStream:
    """Token ids in, text out, never splitting a character: text is released only up to
    the last complete character (a trailing replacement character is held back)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already released

    def add(self, ids: list[int], *, final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        out, self.sent = text[self.sent : end], max(self.sent, end)
        return out


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound at once: a command binds it before its slow
    start (a model's load, replicas awaited), so a taken port is named in seconds. Raises
    OSError (the port taken, the address not this host's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


def listen_for(command: str, host: str, port: int) -> socket.socket | None:
    """`listen`, or None after one error line naming the flag (`--port`, `--host`)."""
    try:
        return listen(host, port)
    except OSError as error:
        flag = "--host" if error.errno == errno.EADDRNOTAVAIL else "--port"
        reason = os.strerror(error.errno) if error.errno else str(error)
        print(f"{command}: error: {flag}: cannot listen on {host}:{port}: {reason}",
              file=sys.stderr, flush=True)  # fmt: skip
        return None


# How long a stop waits for requests in flight (a streamed answer) before cancelling them.
SHUTDOWN_GRACE_S = 0.5


async def serve_until_stopped(app, sock: socket.socket, command: str, banner, close) -> int:
    """Serve `app` on the bound `sock` (`listen`) until SIGTERM or SIGINT, then `await
    close()`: requests in flight get SHUTDOWN_GRACE_S to finish, then are cancelled.

    `banner(port)` is the "listening" line (the port as bound: 0 picks one). For `hicache
    engine serve` and `hicache route`."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):  # before the banner: a stop after it is clean
        loop.add_signal_handler(signum, stop.set)
    await web.SockSite(runner, sock, shutdown_timeout=SHUTDOWN_GRACE_S).start()
    say(banner(sock.getsockname()[1]))
    await stop.wait()
    await runner.cleanup()
    await close()
    say(f"{command}: stopped")
    return 0
