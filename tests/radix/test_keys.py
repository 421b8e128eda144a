import subprocess
import sys

import numpy as np
import pytest
import xxhash

from radix.keys import KEY_BYTES, Namespace, encode_tokens, page_keys

NS = Namespace(model_id="llama-3.1-8b", layout="mha;layers=32;page=4;dtype=bfloat16")


def test_keys_follow_the_chained_definition():
    tokens = list(range(10))
    keys = page_keys(tokens, NS, page_size=4)
    assert len(keys) == 2  # the partial third page has no key
    first = xxhash.xxh3_128_digest(NS.digest + np.arange(4, dtype="<u4").tobytes())
    second = xxhash.xxh3_128_digest(first + np.arange(4, 8, dtype="<u4").tobytes())
    assert keys == [first, second]
    assert all(len(key) == KEY_BYTES for key in keys)


def test_a_key_names_the_whole_prefix():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], NS, page_size=4)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], NS, page_size=4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same page tokens, different prefix


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model_id="llama-3.1-70b", layout=NS.layout),
        Namespace(model_id=NS.model_id, layout="mha;layers=32;page=4;dtype=float16"),
        Namespace(model_id=NS.model_id, layout=NS.layout, tenant="acme"),
        Namespace(model_id=NS.model_id, layout=NS.layout, extra_key="lora-7"),
    ],
)
def test_keys_differ_across_namespaces(other):
    tokens = list(range(16))
    assert other.digest != NS.digest
    assert set(page_keys(tokens, other, 4)).isdisjoint(page_keys(tokens, NS, 4))


def test_namespace_fields_do_not_blur_into_each_other():
    a = Namespace(model_id="ab", layout="c")
    b = Namespace(model_id="a", layout="bc")
    assert a.digest != b.digest


def test_keys_are_identical_in_another_process():
    tokens = [7, 300000, 2**32 - 1, 0, 5, 6, 7, 8]
    here = [key.hex() for key in page_keys(tokens, NS, 4)]
    code = (
        "from radix.keys import Namespace, page_keys; "
        f"ns = Namespace(model_id={NS.model_id!r}, layout={NS.layout!r}); "
        f"print(','.join(k.hex() for k in page_keys({tokens!r}, ns, 4)))"
    )
    # A different hash seed proves nothing depends on Python's hash().
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == here


def test_token_inputs_encode_alike():
    as_list = encode_tokens([1, 2, 3])
    assert encode_tokens(np.array([1, 2, 3], dtype=np.int64)) == as_list
    assert encode_tokens(np.array([1, 2, 3], dtype=np.uint32)) == as_list
    assert encode_tokens(as_list) is as_list


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([-1, 2], "token ids must be in"),
        ([2**32], "token ids must be in"),
        (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
        (np.array([0.5]), "integers"),
        (b"abc", "multiple of 4"),
    ],
)
def test_bad_tokens_are_rejected_with_a_reason(tokens, message):
    with pytest.raises(ValueError, match=message):
        encode_tokens(tokens)


def test_namespace_validation():
    with pytest.raises(ValueError, match="model_id"):
        Namespace(model_id="", layout="x")
    with pytest.raises(TypeError, match="tenant"):
        Namespace(model_id="m", layout="x", tenant=3)
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1], NS, 0)
