"""Tokenizers: a built-in byte-level one, or a model directory's `tokenizer.json`.

The byte tokenizer maps each UTF-8 byte to its value (0-255) and adds `<bos>` (256) and
`<eos>` (257); it needs nothing and round-trips any text. `tokenizer.json` is read through
the `tokenizers` package (the optional extra `hicache[tokenizers]`), imported only when a
model directory has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from engine_integration.errors import CheckpointError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus `<bos>` = 256 and `<eos>` = 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` package."""

    def __init__(self, path: str | Path, eos_id: int | None = None, bos_id: int | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise CheckpointError(
                f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                "(pip install 'hicache[tokenizers]')"
            ) from None
        self._tokenizer = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


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
    return HFTokenizer(path, eos_id=eos, bos_id=hf.get("bos_token_id"))
