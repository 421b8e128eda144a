"""The model: the forward pass of one engine step, and where its weights come from.

    config.py       ModelConfig (architecture, hybrid layer plan), EngineConfig
    hf_config.py    Hugging Face config.json -> ModelConfig (transformers 5.x and 4.x)
    weights.py      ModelWeights: random from a seed, or a safetensors checkpoint
    gguf_checkpoint.py  a GGUF file: its config and dequantized tensors (`gguf` package)
    tokenizer.py    byte-level, tokenizer.json, or a GGUF's metadata, through `tokenizers`
    forward.py      Model: the forward pass of one engine step (source layers, head)
    late_layers.py  its mixin: the boundary residual and the late (sliding-window) layers
    rowwise.py      its mixin: a layer's row-wise parts (norm, projections, RoPE, MLP)
    step_rows.py    SeqRows (a request's rows in a step), HeldRows: which rows are read
    norm_rope.py    RotaryTable, rms_norm, apply_rope in torch's ops
    kernel_support.py  which kernel paths (dense CUDA, deterministic) implement a model
    attention.py    attention over paged source KV; the SDPA and flash calls the window shares
    tile_attention.py  its batch-invariant tiles: nested on the CPU, one masked call elsewhere
    window_attention.py  sliding-window attention over the window ring (late or windowed layers)
    rows.py         RowLayout: rows in fixed groups by position (batch invariance on the CPU)
    window.py       LateWindow: the late layers' ring of W tokens per request
    paged_attention.py  CUDA: a few queries straight over a request's pages (Triton)
    fused.py        CUDA: RMS norm, and RoPE with the K/V rows, one Triton kernel each
    graphs.py       CUDA graphs of a layer's parts (or of a whole source layer), per row bucket
    deterministic.py  the deterministic path's batch-invariant matmul and SwiGLU (Triton)
    deterministic_attention.py  its attention: keys cut at fixed positions, merged in order

It knows nothing of requests or scheduling; of the engine it imports only `errors`.
"""
