"""engine_integration: the users of hicache, in four rooms.

    engine/     the embedded decoding engine: scheduler, requests, pages, encoder replay
      model/    its forward pass and checkpoint loading (HF safetensors, GGUF, tokenizer)
    serve/      HTTP over the engine: the OpenAI-compatible replica (`hicache engine serve`),
                the router (`hicache route`) and `hicache demo`
    sglang/     hicache as SGLang's L3 storage backend
    vllm/       hicache as vLLM's KV connector

Imports: `serve -> engine`; `sglang` and `vllm` stand apart from both and from each other.
All four import `hicache` and the packages below it, never the other way round: the
subcommands of `hicache` are registered as entry points (pyproject.toml). The contract is
in pyproject.toml and checked by tests/test_layering.py.

Where to look (one module each):
    what happens in match()           hicache/controller.py (`HiCache.match`; hicache/match.py,
                                      hicache/match_steps.py)
    the load-or-recompute decision    hicache/fetch_plan.py (the engine asks through pages.py)
    where a batch is written to L3    hicache/mover.py (`PageMover`: every op it submits)
    where a page is verified          storage_backends/verify.py (every backend reads through it)
    what happens to a request         engine/core.py, engine/scheduler.py, engine/pages.py

`vllm_connector.py` and `sglang_storage.py` are the 0.1 paths of the two adapters, kept for
one release with a DeprecationWarning. Importing the package does not import torch.
"""
