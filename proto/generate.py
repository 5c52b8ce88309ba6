"""Regenerate the protobuf and gRPC stubs from ``shardps.proto``.

Run from anywhere (needs the ``dev`` extra, which pins grpcio-tools)::

    python -m shardps.proto.generate

The generated ``shardps_pb2.py``, ``shardps_pb2.pyi`` and
``shardps_pb2_grpc.py`` are committed and never edited by hand;
``tests/unit/test_generated.py`` regenerates them into a temporary folder
and proves the committed copies match.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
GENERATED = ("shardps_pb2.py", "shardps_pb2.pyi", "shardps_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on ``shardps.proto`` and write the stubs to ``out_dir``.

    The .proto is compiled as ``shardps/proto/shardps.proto`` so that the
    generated gRPC module imports ``shardps.proto.shardps_pb2``.

    Raises:
        RuntimeError: protoc failed (its exit code is in the message).
        ImportError: grpcio-tools is not installed (``pip install -e .[dev]``).
    """
    from grpc_tools import protoc  # dev-only dependency

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shardps" / "proto"
        src.mkdir(parents=True)
        shutil.copy(PROTO_DIR / "shardps.proto", src / "shardps.proto")
        out = Path(tmp) / "out"
        out.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            "shardps/proto/shardps.proto",
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copy(out / "shardps" / "proto" / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
