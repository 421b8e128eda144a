"""The embedded decoding engine: continuous batching over hicache's pages.

    core.py         Engine: add_request / step / generate
    scheduler.py    continuous batching, chunked prefill, the replay plan
    request.py      a request's state, its window ring and its metrics
    sampling.py     SamplingParams and sampling from logits
    pages.py        PageSource: hicache (CachedPages) or a private pool (cache off)
    sidecar.py      an interleaved model's sidecars: their KV to and from cache pages
    sidecar_shape.py  their shape and keys (no torch: the router reads them too)
    embedded.py     load_model, build_cache: an engine put together (SmolLM2 by default)
    errors.py       EngineError and its kinds
    model/          the forward pass of one step and the loading of checkpoints

Imports go down that list and into `model/`; `model/` imports only `errors` from here.
Importing the package does not import torch; the modules that compute do.
"""
