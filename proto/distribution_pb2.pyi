from starfed.proto import codebook_pb2 as _codebook_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("held_version", "federation")
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEDERATION_FIELD_NUMBER: _ClassVar[int]
    held_version: int
    federation: str
    def __init__(self, held_version: _Optional[int] = ..., federation: _Optional[str] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("codebook", "unchanged", "version")
    CODEBOOK_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    codebook: _codebook_pb2.Codebook
    unchanged: bool
    version: int
    def __init__(self, codebook: _Optional[_Union[_codebook_pb2.Codebook, _Mapping]] = ..., unchanged: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...
