"""The demo's settings (`DemoConfig`, one field a flag of `hicache demo`) and the helpers
its command line and its run share. Torch-free."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BUILTIN = "builtin"  # --model builtin: the built-in random model
GEMMA3 = "gemma3"  # --model gemma3: Gemma 3 270M (base) from its package


@dataclass(frozen=True)
class DemoConfig:
    device: str = "cpu"
    model: str | None = None  # a GGUF file or HF directory; None: SmolLM2 if installed
    window_layers: int | None = None  # None: 2 on a full-attention checkpoint, else its own
    window: int = 64  # the window of those layers, in tokens
    l3_url: str | None = None  # None: file://<user cache dir>/hicache/demo-l3
    l3_capacity: str = "512MiB"  # for the default L3 directory
    turns: int = 4
    users: int = 4
    max_new_tokens: int = 32
    concurrency: int = 1  # requests in flight at once (continuous batching)
    # None: 10 (SmolLM2), 32 (the built-in byte-level model), times concurrency
    l1_pages: int | None = None
    l2_pages: int | None = None  # None: 12 (SmolLM2), 48 (the built-in model), times concurrency
    page_size: int = 64
    seed: int = 0
    threads: int = 1  # torch CPU threads (steady on a busy machine; more can help when idle)
    compare: bool = True  # also run with the cache off
    fresh: bool = False  # empty the default L3 directory first
    deterministic: bool | None = None  # EngineConfig.deterministic; None: on CUDA if it can

    def __post_init__(self) -> None:
        positive = (
            "turns",
            "users",
            "max_new_tokens",
            "concurrency",
            "page_size",
            "window",
            "threads",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.window_layers is not None and self.window_layers < 0:
            raise ValueError(f"--window-layers must be >= 0, got {self.window_layers}")
        if self.l1_pages is not None and self.l1_pages < 1:
            raise ValueError(f"--l1-pages must be >= 1, got {self.l1_pages}")
        if self.l2_pages is not None and self.l2_pages < 0:
            raise ValueError(f"--l2-pages must be >= 0, got {self.l2_pages}")
        if self.fresh and self.l3_url:
            raise ValueError(
                "--fresh empties the demo's own L3 directory; with --l3-url, empty that "
                "store yourself (or point the demo at another one)"
            )
        if self.deterministic and not self.device.startswith("cuda"):
            raise ValueError(
                "--deterministic runs its kernels on CUDA (--device cuda); on the CPU the "
                "engine is batch-invariant, bitwise, already"
            )
        if self.l3_url and self.l2_pages == 0:
            raise ValueError("an L3 needs an L2 (--l2-pages > 0): pages reach L3 through L2")


def default_l3_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache" / "demo-l3"


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """A progress line for a step that takes seconds: what it does, then how long it took."""
    print(f"hicache demo: {what}...", end="", flush=True)
    started = time.perf_counter()
    try:
        yield
    except Exception:
        print(" failed", flush=True)
        raise
    except BaseException:  # Ctrl-C or SIGTERM: the command says so on the next line
        print(" stopped", flush=True)
        raise
    print(f" {time.perf_counter() - started:.1f} s", flush=True)
