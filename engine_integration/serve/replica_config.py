"""One replica's settings, checked before anything slow starts. Torch-free: the command line
(`engine_cli.py`) builds and checks a `ReplicaConfig` before the model loads."""

from __future__ import annotations

from dataclasses import dataclass

from engine_integration.engine.model.config import ModelConfig

ROLES = ("both", "prefill", "decode")
DTYPES = ("float32", "bfloat16", "float16")
L3_FETCHES = ("measured", "always")


def fetch_policies(role: str, l3_fetch: str | None) -> dict[str, str]:
    """The `PolicyConfig` fields that say how a replica reads a run L3 holds. `measured`
    fetches what beats recomputing it by the rates the cache measures and waits for a
    prefetch up to its timeout; `always` fetches the whole run and waits for all of it, as a
    decode replica must (the prefill side computed the prompt so that it would not). None:
    the role's own (`always` for decode, else `measured`)."""
    fetch = l3_fetch or ("always" if role == "decode" else "measured")
    return {
        "l3_fetch_policy": fetch,
        "prefetch_policy": "wait_complete" if fetch == "always" else "timeout",
    }


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica: its model, its cache, its role, where it listens and publishes."""

    model_path: str | None = None  # None: the built-in tiny model (random weights)
    model_config: ModelConfig | None = None  # or a synthetic model of this shape (random)
    seed: int = 0
    name: str = ""
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8100  # 0: any free port (printed on start)
    page_size: int = 64
    max_running_requests: int = 8
    l1_pages: int = 512
    l2_pages: int = 0
    l3_url: str | None = None
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str | None = None  # None: kv@<host>@<model>
    events_format: str = "vllm"  # or "sglang"
    threads: int = 0  # torch's CPU threads (0: torch's default)
    device: str = "cpu"  # or "cuda[:N]"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on CUDA
    cache: bool = True  # False: no hicache at all (the baseline a cache is measured against)
    deterministic: bool = False  # EngineConfig.deterministic (CUDA)
    l3_fetch: str | None = None  # `fetch_policies`; None: the role's own

    def __post_init__(self) -> None:
        if self.model_path and self.model_config:
            raise ValueError("give --model or --model-config, not both")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != "both" and not self.l3_url:
            raise ValueError(f"--role {self.role} hands prompts over through L3: give --l3-url")
        if self.l3_url and not self.l2_pages:
            raise ValueError("--l3-url needs --l2-pages > 0 (pages reach L3 through L2)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.l1_pages < 1:
            raise ValueError(f"--l1-pages must be >= 1, got {self.l1_pages}")
        if self.events_replay_endpoint and not self.events_endpoint:
            raise ValueError("--events-replay-endpoint needs --events-endpoint")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.cache:
            kept = [flag for flag, value in (("--l2-pages", self.l2_pages),
                    ("--l3-url", self.l3_url), ("--events-endpoint", self.events_endpoint),
                    ("--role", self.role != "both")) if value]  # fmt: skip
            if kept:
                raise ValueError(f"--no-cache leaves no cache for {', '.join(kept)}")
        if self.deterministic and not self.device.startswith("cuda"):
            raise ValueError(
                "--deterministic runs its kernels on CUDA (--device cuda); on the CPU the "
                "engine is batch-invariant, bitwise, already"
            )
        if self.l3_fetch is not None:
            if self.l3_fetch not in L3_FETCHES:
                raise ValueError(
                    f"--l3-fetch must be one of {', '.join(L3_FETCHES)}, got {self.l3_fetch!r}"
                )
            if not self.l3_url:
                raise ValueError("--l3-fetch says how to read L3: give --l3-url")
            if self.role == "decode" and self.l3_fetch != "always":
                raise ValueError(
                    "--role decode fetches a handed-off prompt whole: --l3-fetch measured "
                    "would recompute what the prefill side computed"
                )
        if self.events_format not in ("vllm", "sglang"):
            raise ValueError(f"--events-format must be vllm or sglang, got {self.events_format!r}")
