"""engine_integration: users of hicache; here, the embedded decoding engine.

A small but real engine that gets prefix hits from L1, L2 and L3 through `hicache.HiCache`
and rebuilds its sliding-window layers by encoder replay (DESIGN.md):

    config.py       ModelConfig (architecture, hybrid layer plan), EngineConfig
    hf_config.py    Hugging Face config.json <-> ModelConfig fields (5.x and 4.x)
    weights.py      ModelWeights: random from a seed, or a safetensors checkpoint
    gguf_checkpoint.py  a GGUF file: its config and dequantized tensors (`gguf` package)
    tokenizer.py    byte-level, tokenizer.json, or a GGUF's metadata, through `tokenizers`
    rows.py         RowLayout: rows in fixed groups by position (batch invariance on the CPU)
    attention.py    attention over paged source KV and over the late window
    paged_attention.py  CUDA: a few queries straight over a request's pages (Triton)
    fused.py        CUDA: RMS norm, and RoPE with the K/V rows, one Triton kernel each
    graphs.py       CUDA graphs of a layer's parts (or of a whole source layer), per row bucket
    window.py       LateWindow: the late layers' ring of W tokens per request
    model.py        Model: the forward pass of one engine step
    pages.py        PageSource: hicache (CachedPages) or a private pool (cache off)
    scheduler.py    continuous batching, chunked prefill, the replay plan
    engine.py       Engine: add_request / step / generate
    embedded.py     load_model, build_cache: an engine put together (SmolLM2 by default)
    workload.py     the demo's multi-turn chat: real questions, token-exact histories
    demo.py         `hicache demo` (command line; torch-free) and demo_runner.py (the run)

Nothing imports this package; it imports hicache, tiers and radix. Importing the package
(and `demo`) does not import torch; the modules that compute do.
"""
