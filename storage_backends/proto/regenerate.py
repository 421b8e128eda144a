"""Regenerate kvstore_pb2.py, kvstore_pb2.pyi and kvstore_pb2_grpc.py from kvstore.proto.

    python -m storage_backends.proto.regenerate          # rewrite the checked-in files
    python -m storage_backends.proto.regenerate OUTDIR   # write them under OUTDIR instead

Needs grpcio-tools (the `dev` extra). Run from anywhere: paths are relative to this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("kvstore.proto")
ROOT = PROTO.parents[2]  # the repository root: the proto's import path starts there
PROTO_NAME = PROTO.relative_to(ROOT).as_posix()  # storage_backends/proto/kvstore.proto
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Compile the proto with grpcio-tools into `out_root` (mirroring the package path)."""
    from grpc_tools import protoc  # dev dependency: imported only to regenerate

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        PROTO_NAME,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_NAME}")
    return [out_root / PROTO.parent.relative_to(ROOT) / name for name in GENERATED]


def main(argv: list[str]) -> int:
    out_root = Path(argv[0]) if argv else ROOT
    for path in generate(out_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
