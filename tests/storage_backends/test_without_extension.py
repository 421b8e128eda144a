"""The storage backends without the C extension, and the checksum's fixed vectors.

An install without a C compiler has no `storage_backends._pageio`: memory://, redis:// and
grpc:// must still import and keep their whole contract (on `portable`), and file://, which
needs the extension, must say in one line what to install. A subprocess hides the extension
(a meta-path blocker in a `sitecustomize` on its PYTHONPATH, so the cache-server daemons it
starts run without it too) and runs the contract suite for those backends.

The fixed vectors hold the checksum to the XXH3-64 digests objects were stored under before
the hash came from the xxHash library (taken from the hand-written XXH3 it replaced; the
empty input's is the algorithm's published one), so objects already stored stay valid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xxhash

from storage_backends import native, portable
from storage_backends.objects import frame_objects, layout_bytes

REPO = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent(
    """
    import sys

    class _HideExtension:
        def find_spec(self, name, path=None, target=None):
            if name == "storage_backends._pageio":
                raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
            return None

    sys.meta_path.insert(0, _HideExtension())
    """
)

RUN = textwrap.dedent(
    """
    import sys
    import pytest
    from storage_backends import BackendConfigError, native, open_backend, portable

    assert native.pageio is None and native.checks is portable, native.checks
    try:
        open_backend("file://" + sys.argv[1], layout="x")
    except BackendConfigError as exc:
        print("FILE:", exc)
    else:
        raise SystemExit("file:// opened without the C extension")
    sys.exit(pytest.main(["-q", "-x", "-p", "no:randomly", sys.argv[2], "-k", "not file"]))
    """
)


def data(length: int) -> bytes:
    return bytes((i * 167 + 13) & 0xFF for i in range(length))


# (length of data(length), its XXH3-64 as the hand-written XXH3 computed it)
VECTORS = [
    (0, 0x2D06800538D394C2),
    (1, 0x8A21D78B1538B1C0),
    (3, 0x5F1FA6D2A3AA5A3B),
    (4, 0xA8A9B82C81542A43),
    (8, 0x67B8F67A80D308A6),
    (9, 0x7DF166798FE37670),
    (16, 0xC0967FEE676A5837),
    (17, 0xBC307578D06E9D93),
    (128, 0xA45617BFE9BB88D6),
    (129, 0x4CA31F6B2CFD9A3E),
    (240, 0x2817ED3CDF9547E7),
    (241, 0x02F838DD48200EE8),
    (1024, 0x4ECDE09865C37511),
    (1025, 0xA08B2694BF52957E),
    (4159, 0x8AEA967D19028E96),
    (65593, 0x2AF6453A29F8B1F4),
    (1048581, 0x3CCED6189766A75A),
]

# The header the hand-written XXH3's build framed for key bytes(range(16)) and page data(4096).
STORED_LAYOUT = "mha;layers=2;page=16;kv_heads=2;head_dim=8;dtype=bfloat16"
STORED_HEADER = bytes.fromhex(
    "48434b56010000003900000000000000000102030405060708090a0b0c0d0e0f0010000000000000"
    "00100000000000004ce28b8ed6f3aafe6d68613b6c61796572733d323b706167653d31363b6b765f"
    "68656164733d323b686561645f64696d3d383b64747970653d62666c6f61743136"
)


def implementations() -> list:
    return [native.pageio, portable] if native.pageio is not None else [portable]


@pytest.mark.parametrize("impl", implementations(), ids=lambda m: m.__name__.split(".")[-1])
def test_the_checksum_keeps_its_fixed_vectors(impl):
    units = ["baseline", "avx2", "avx512"] if impl is native.pageio else [None]
    for unit in units:
        if unit is not None:
            default = impl.simd()
            try:
                impl.simd(unit)
            except ValueError:
                continue
        try:
            for length, digest in VECTORS:
                page = data(length)
                assert impl.xxh3_64(page) == digest, (unit, length)
                assert impl.xxh3_64(page[:7], page[7:]) == digest, (unit, length)
                assert xxhash.xxh3_64_intdigest(page) == digest, length
        finally:
            if unit is not None:
                impl.simd(default)


@pytest.mark.parametrize("impl", implementations(), ids=lambda m: m.__name__.split(".")[-1])
def test_an_object_stored_before_still_checks_out(impl, monkeypatch):
    from storage_backends import objects

    monkeypatch.setattr(objects, "checks", impl)
    key, page = bytes(range(16)), data(4096)
    framed = frame_objects([key], STORED_LAYOUT, [page])[0]
    assert framed.header == STORED_HEADER
    layout = layout_bytes(STORED_LAYOUT)
    assert impl.check_object([STORED_HEADER, page], key, layout, len(page)) == 1


def test_memory_redis_and_grpc_keep_their_contract_without_the_extension(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    contract = str(REPO / "tests" / "storage_backends" / "test_contract.py")
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "kv"), contract],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    file_lines = [line for line in result.stdout.splitlines() if line.startswith("FILE:")]
    assert len(file_lines) == 1, result.stdout[-2000:]
    assert "storage_backends._pageio" in file_lines[0] and "libxxhash-dev" in file_lines[0]
    assert " passed" in result.stdout and " failed" not in result.stdout
