"""The committed stubs are exactly what ``python -m shardps.proto.generate`` produces from the .proto."""

from pathlib import Path

import pytest

from shardps.proto import generate


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools comes with the dev extra")
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        committed = (generate.PROTO_DIR / name).read_text()
        fresh = (tmp_path / name).read_text()
        assert committed == fresh, f"{name} is stale: run python -m shardps.proto.generate"
