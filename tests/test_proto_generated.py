"""The committed protobuf modules are what ``proto/generate.py`` produces from the schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from starfed.proto import codebook_pb2 as pb
from starfed.proto import distribution_pb2
from starfed.proto.generate import PROTO_DIR, generate


def test_committed_modules_match_the_schema(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the modules")
    written = generate(tmp_path)
    assert sorted(p.name for p in written) == [
        "codebook_pb2.py",
        "codebook_pb2.pyi",
        "distribution_pb2.py",
        "distribution_pb2.pyi",
        "distribution_pb2_grpc.py",  # only files with a service get gRPC stubs
    ]
    for path in written:
        committed = PROTO_DIR / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run `python -m starfed.proto.generate` and commit the result"
        )


def test_module_lives_in_the_starfed_namespace() -> None:
    assert pb.Codebook.__module__ == "starfed.proto.codebook_pb2"
    assert pb.DESCRIPTOR.name == "starfed/proto/codebook.proto"
    assert pb.DESCRIPTOR.package == "starfed.codebook.v1"
    # the service's reply carries the codebook message itself, across the two files
    reply = distribution_pb2.FetchReply.DESCRIPTOR.fields_by_name["codebook"]
    assert reply.message_type is pb.Codebook.DESCRIPTOR
    service = distribution_pb2.DESCRIPTOR.services_by_name["CodebookDistribution"]
    assert service.full_name == "starfed.distribution.v1.CodebookDistribution"


def test_field_numbers_are_kept_for_the_distribution_service() -> None:
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    codebook = next(m for m in file.message_type if m.name == "Codebook")
    assert [(r.start, r.end) for r in codebook.reserved_range] == [(18, 32)]
