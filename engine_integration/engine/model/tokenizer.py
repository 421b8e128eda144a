"""Tokenizers: a built-in byte-level one, a model directory's `tokenizer.json`, or the
tokenizer a GGUF file describes in its metadata.

The byte tokenizer maps each UTF-8 byte to its value (0-255) and adds `<bos>` (256) and
`<eos>` (257); it needs nothing and round-trips any text. The others go through the
`tokenizers` package, imported only when needed. A GGUF file stores a byte-level BPE
vocabulary (`tokenizer.ggml.model` "gpt2") as its tokens, merges, token types (control
tokens become special tokens) and the name of its pre-tokenizer (`tokenizer.ggml.pre`):
`gguf_tokenizer` rebuilds the `tokenizers` pipeline from those, refusing a pre-tokenizer or
model it does not know by name. Gemma's files store a SentencePiece BPE vocabulary instead
(`tokenizer.ggml.model` "llama", architecture gemma*) with no merges: `_sentencepiece_bpe`
recovers them from the vocabulary (see there), as transformers does when it loads the file.
Such a tokenizer prepends `<bos>` when the file says so (`tokenizer.ggml.add_bos_token`):
Gemma's text degenerates without it. Chat templates (Jinja, from the GGUF metadata or
`tokenizer_config.json`) render in a sandbox, as transformers renders them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine_integration.engine.errors import CheckpointError

# How each GGUF pre-tokenizer splits text before BPE (llama.cpp's names). "digits": every
# digit alone, then GPT-2's split; the regexes are those of the models' tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,  # GPT-2's split
    "gpt2": None,
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
# Architectures whose "llama" (SentencePiece) vocabulary `_sentencepiece_bpe` rebuilds.
SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    # continuation: the text continues a sequence already begun (no <bos> before it)
    def encode(self, text: str, *, continuation: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus `<bos>` = 256 and `<eos>` = 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str, *, continuation: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a tokenizer.json or built from GGUF metadata), with
    the model's chat template if it has one."""

    def __init__(
        self,
        tokenizer,
        *,
        eos_id: int | None = None,
        bos_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos: bool = False,
    ):
        self._tokenizer = tokenizer
        self.add_bos = add_bos and bos_id is not None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        self.eos_text = self._special_tokens.get("eos_token")  # the end-of-turn token's text

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> HFTokenizer:
        return cls(_tokenizers().Tokenizer.from_file(str(path)), **kwargs)

    def encode(self, text: str, *, continuation: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) are matched.
        With `add_bos`, `<bos>` first, unless the text begins with it already (a chat
        template that writes it) or is a `continuation` of a sequence begun before."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and not continuation and ids[:1] != [self.bos_id]:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The text of `messages` ({"role", "content"} dicts) in the model's chat format."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template")
        return _render_template(
            self.chat_template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise CheckpointError(
            "reading a model's tokenizer needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    return tokenizers


def _render_template(template: str, **variables: Any) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**variables)
    except TemplateError as error:
        raise CheckpointError(f"the chat template failed: {error}") from None


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """`tokenizer.json` of `model_dir` when there is one, else the byte tokenizer."""
    if model_dir is None:
        return ByteTokenizer()
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return ByteTokenizer()
    config_path = Path(model_dir) / "config.json"
    hf = json.loads(config_path.read_text()) if config_path.is_file() else {}
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    extra_path = Path(model_dir) / "tokenizer_config.json"
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else {}
    template = extra.get("chat_template")
    specials = {
        k: v for k, v in extra.items() if k in ("bos_token", "eos_token") and isinstance(v, str)
    }
    return HFTokenizer.from_file(
        path,
        eos_id=eos,
        bos_id=hf.get("bos_token_id"),
        chat_template=template if isinstance(template, str) else None,
        special_tokens=specials,
    )


def gguf_tokenizer(metadata: Mapping[str, Any], source: str = "GGUF") -> HFTokenizer:
    """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    tk = _tokenizers()
    kind = metadata.get("tokenizer.ggml.model")
    arch = str(metadata.get("general.architecture", ""))
    if kind == "llama" and arch in SENTENCEPIECE_ARCHITECTURES:
        return _sentencepiece_bpe(tk, metadata)
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported for architecture "
            f"{arch!r} (gpt2: byte-level BPE; llama: SentencePiece BPE, for "
            f"{', '.join(SENTENCEPIECE_ARCHITECTURES)})"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(GGUF_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    model = tk.models.BPE(
        {token: i for i, token in enumerate(tokens)},
        merges,
        ignore_merges=GGUF_PRE_TOKENIZERS[pre] == _LLAMA3_SPLIT,
    )
    tokenizer = tk.Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer(tk, GGUF_PRE_TOKENIZERS[pre])
    tokenizer.decoder = tk.decoders.ByteLevel()
    return _finish(tk, tokenizer, tokens, metadata, add_bos=False)


def _finish(tk, tokenizer, tokens: list[str], metadata, *, add_bos: bool) -> HFTokenizer:
    """The file's control tokens (special) and user-defined ones (whole, not special) added
    to `tokenizer`, and its specials and chat template."""
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tokenizer.add_tokens(
        [
            tk.AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )

    def token_id(name: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos, eos = token_id("bos"), token_id("eos")
    return HFTokenizer(
        tokenizer,
        eos_id=eos,
        bos_id=bos,
        chat_template=metadata.get("tokenizer.chat_template"),
        special_tokens={
            "bos_token": tokens[bos] if bos is not None else None,
            "eos_token": tokens[eos] if eos is not None else None,
        },
        add_bos=add_bos,
    )


_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_bpe(tk, metadata: Mapping[str, Any]) -> HFTokenizer:
    """Gemma's SentencePiece BPE: spaces become U+2581, no pre-split, byte fallback.

    The file lists no merges. BPE merges a pair where the merged piece is in the
    vocabulary, best piece first; for Gemma the best is the earliest in the file (its scores
    do not follow the merge order). So every piece splits into each (left, right) pair of
    pieces that are both in the vocabulary, ranked by the piece's position, and within one
    piece longer left parts first. A piece of two or more plain spaces is stored with real
    spaces; it is looked up after the normaliser, so it is renamed to U+2581s."""
    tokens = [
        _SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t
        for t in metadata["tokenizer.ggml.tokens"]
    ]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):  # longer left parts first
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    model = tk.models.BPE(
        vocab, merges, unk_token=tokens[_unknown(metadata)], fuse_unk=True, byte_fallback=True
    )
    tokenizer = tk.Tokenizer(model)
    tokenizer.normalizer = tk.normalizers.Replace(" ", _SPACE)
    tokenizer.decoder = tk.decoders.Sequence(
        [tk.decoders.Replace(_SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    return _finish(tk, tokenizer, tokens, metadata, add_bos=add_bos)


def _unknown(metadata: Mapping[str, Any]) -> int:
    value = metadata.get("tokenizer.ggml.unknown_token_id")
    if value is None or not 0 <= int(value) < len(metadata["tokenizer.ggml.tokens"]):
        raise CheckpointError(f"GGUF tokenizer.ggml.unknown_token_id {value!r} is not a token")
    return int(value)


def _pre_tokenizer(tk, split: str | None):
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is None:
        return byte_level
    if split == "digits":
        return tk.pre_tokenizers.Sequence(
            [
                tk.pre_tokenizers.Digits(individual_digits=True),
                tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return tk.pre_tokenizers.Sequence(
        [tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"), byte_level]
    )
