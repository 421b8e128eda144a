"""`hicache simulate`: capacity planning for tiered KV caches, on the live cache's own code.

A trace plays, in virtual time, through real `hicache.HiCache` controllers (one per
serving instance) whose executor is `VirtualExecutor`: the radix index, the write,
prefetch and eviction policies are the live cache's, so the hit rates are its hit rates;
only the clock and the byte movement are modelled. Nothing here imports torch.

    trace.py      Mooncake JSONL traces, and a seeded multi-turn conversation generator
    models.py     ModelSpec: KV bytes per token, weights, prefill FLOPs
    hf_config.py  a Hugging Face config.json as a ModelSpec;  model_presets.py: the presets
    hardware.py   GPU presets: HBM, host memory, links, FLOPs, price
    config.py     SimulationConfig: instances, tier sizes, links, policies, prices
    l3.py         SimulatedL3: a shared LRU store whose pages appear when their write ends
    executor.py   VirtualExecutor: the controller's ops on contended links in virtual time
    player.py     TracePlayer: routing, queueing, match / prefill / insert, TTFT
    decode.py     DecodeSteps: an engine's decode steps between prefills (engine requests)
    profile.py    HardwareProfile: a replica's measured costs;  calibrate.py: --calibrate
    result.py     SimulationResult: hit rates, TTFT, bytes per link, costs
    sweep.py      capacity sweeps, run in parallel processes
    verdict.py    where the next dollar of cache goes; whether a shared L3 pays off
    report.py     text and Markdown tables;  plots.py: a sweep's PNG (matplotlib, Agg)
    progress.py   a progress bar on stderr;  cli.py: `hicache simulate`
    flags.py      its flags;  flag_config.py: their checks, and the SimulationConfig they make
"""

from hicache.simulate.config import SimulationConfig
from hicache.simulate.player import TracePlayer
from hicache.simulate.result import SimulationResult
from hicache.simulate.trace import Trace, load_trace


def simulate(config: SimulationConfig, trace: Trace, progress=None) -> SimulationResult:
    """Play `trace` under `config`; `progress(done, total)` is called as requests finish."""
    return TracePlayer(config, trace, progress).run()


Replay = TracePlayer  # its name until issue 34 (deprecated: "replay" is the engine's word)

__all__ = [
    "Replay",
    "SimulationConfig",
    "SimulationResult",
    "Trace",
    "TracePlayer",
    "load_trace",
    "simulate",
]
