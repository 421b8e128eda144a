"""KVLayout: validation, derived sizes, and the descriptor round trip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiers.layout import DTYPE_BYTES, KVLayout

LLAMA_8B = KVLayout(
    "mha", num_layers=32, page_size=64, dtype="bfloat16", num_kv_heads=8, head_dim=128
)
DSV3 = KVLayout("mla", num_layers=61, page_size=16, dtype="bfloat16", kv_lora_rank=512, rope_dim=64)


def test_mha_sizes_match_llama_8b():
    assert LLAMA_8B.token_shape == (2, 8, 128)
    assert LLAMA_8B.dtype_bytes == 2
    assert LLAMA_8B.bytes_per_token_per_layer == 4096
    assert LLAMA_8B.bytes_per_page_per_layer == 64 * 4096
    assert LLAMA_8B.bytes_per_page == 32 * 64 * 4096
    assert LLAMA_8B.bytes_per_token == 32 * 4096


def test_mla_sizes_match_deepseek_v3():
    assert DSV3.token_shape == (1, 576)
    assert DSV3.bytes_per_token_per_layer == 1152
    assert DSV3.bytes_per_page_per_layer == 16 * 1152
    assert DSV3.bytes_per_page == 61 * 16 * 1152


def test_descriptor_is_stable_and_round_trips():
    assert LLAMA_8B.descriptor() == "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16"
    assert DSV3.descriptor() == "mla;layers=61;page=16;kv_lora_rank=512;rope_dim=64;dtype=bfloat16"
    for layout in (LLAMA_8B, DSV3):
        assert KVLayout.from_descriptor(layout.descriptor()) == layout


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_every_dtype_round_trips_and_maps_to_torch(dtype):
    import torch

    layout = KVLayout("mha", num_layers=2, page_size=4, dtype=dtype, num_kv_heads=1, head_dim=8)
    assert KVLayout.from_descriptor(layout.descriptor()) == layout
    assert torch.empty(0, dtype=layout.torch_dtype).element_size() == layout.dtype_bytes


def test_layouts_that_differ_have_different_descriptors():
    other = KVLayout(
        "mha", num_layers=32, page_size=64, dtype="float16", num_kv_heads=8, head_dim=128
    )
    assert other.descriptor() != LLAMA_8B.descriptor()
    assert other != LLAMA_8B


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "gqa"}, "kind"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"dtype": "float64"}, "dtype"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": -1}, "head_dim"),
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ],
)
def test_bad_mha_fields_are_named(kwargs, field):
    base = dict(kind="mha", num_layers=2, page_size=4, dtype="bfloat16", num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=field):
        KVLayout(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"rope_dim": -1}, "rope_dim"),
        ({"head_dim": 64}, "head_dim"),
    ],
)
def test_bad_mla_fields_are_named(kwargs, field):
    base = dict(kind="mla", num_layers=2, page_size=4, dtype="bfloat16", kv_lora_rank=8, rope_dim=4)
    with pytest.raises(ValueError, match=field):
        KVLayout(**{**base, **kwargs})


def test_layout_is_frozen():
    with pytest.raises(AttributeError):
        LLAMA_8B.page_size = 16


@pytest.mark.parametrize(
    "descriptor",
    [
        "",
        "gqa;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16",
        "mha;page=64;layers=32;kv_heads=8;head_dim=128;dtype=bfloat16",  # keys out of order
        "mha;layers=32;page=64;kv_heads=8;head_dim=128",  # missing dtype
        "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16;extra=1",
        "mha;layers=32;page=064;kv_heads=8;head_dim=128;dtype=bfloat16",  # not canonical
        "mha;layers=-3;page=64;kv_heads=8;head_dim=128;dtype=bfloat16",
        "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=float64",
        "mha;layers=32;page;kv_heads=8;head_dim=128;dtype=bfloat16",
    ],
)
def test_from_descriptor_rejects_anything_else(descriptor):
    with pytest.raises(ValueError, match="descriptor|KVLayout"):
        KVLayout.from_descriptor(descriptor)


def test_layout_module_does_not_import_torch():
    code = (
        "import sys; from tiers.layout import KVLayout; "
        "KVLayout('mha', 2, 4, 'bfloat16', num_kv_heads=1, head_dim=8).descriptor(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
