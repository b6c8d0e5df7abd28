from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_SYNC: _ClassVar[Phase]
    PHASE_STAGE1: _ClassVar[Phase]
    PHASE_STAGE1_STATS: _ClassVar[Phase]
    PHASE_STAGE2: _ClassVar[Phase]
    PHASE_STAGE2_STATS: _ClassVar[Phase]
    PHASE_EVALUATE: _ClassVar[Phase]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT64: DType
PHASE_UNSPECIFIED: Phase
PHASE_SYNC: Phase
PHASE_STAGE1: Phase
PHASE_STAGE1_STATS: Phase
PHASE_STAGE2: Phase
PHASE_STAGE2_STATS: Phase
PHASE_EVALUATE: Phase

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Mixture(_message.Message):
    __slots__ = ("weights", "means", "variances", "count")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MEANS_FIELD_NUMBER: _ClassVar[int]
    VARIANCES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    weights: Tensor
    means: Tensor
    variances: Tensor
    count: int
    def __init__(self, weights: _Optional[_Union[Tensor, _Mapping]] = ..., means: _Optional[_Union[Tensor, _Mapping]] = ..., variances: _Optional[_Union[Tensor, _Mapping]] = ..., count: _Optional[int] = ...) -> None: ...

class ModelDims(_message.Message):
    __slots__ = ("d_txt", "d_clip", "d_vit", "n_layers")
    D_TXT_FIELD_NUMBER: _ClassVar[int]
    D_CLIP_FIELD_NUMBER: _ClassVar[int]
    D_VIT_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    d_txt: int
    d_clip: int
    d_vit: int
    n_layers: int
    def __init__(self, d_txt: _Optional[int] = ..., d_clip: _Optional[int] = ..., d_vit: _Optional[int] = ..., n_layers: _Optional[int] = ...) -> None: ...

class ClassEntry(_message.Message):
    __slots__ = ("name", "count", "prompt", "key", "query_prompt", "query_weight", "head_weight", "head_bias", "aligned_head_weight", "aligned_head_bias", "clip_mixture", "vit_mixture", "version", "frozen", "field_versions")
    class FieldVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    QUERY_PROMPT_FIELD_NUMBER: _ClassVar[int]
    QUERY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HEAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HEAD_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_HEAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_HEAD_BIAS_FIELD_NUMBER: _ClassVar[int]
    CLIP_MIXTURE_FIELD_NUMBER: _ClassVar[int]
    VIT_MIXTURE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    FIELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    prompt: Tensor
    key: Tensor
    query_prompt: Tensor
    query_weight: Tensor
    head_weight: Tensor
    head_bias: Tensor
    aligned_head_weight: Tensor
    aligned_head_bias: Tensor
    clip_mixture: Mixture
    vit_mixture: Mixture
    version: int
    frozen: bool
    field_versions: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., prompt: _Optional[_Union[Tensor, _Mapping]] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., query_prompt: _Optional[_Union[Tensor, _Mapping]] = ..., query_weight: _Optional[_Union[Tensor, _Mapping]] = ..., head_weight: _Optional[_Union[Tensor, _Mapping]] = ..., head_bias: _Optional[_Union[Tensor, _Mapping]] = ..., aligned_head_weight: _Optional[_Union[Tensor, _Mapping]] = ..., aligned_head_bias: _Optional[_Union[Tensor, _Mapping]] = ..., clip_mixture: _Optional[_Union[Mixture, _Mapping]] = ..., vit_mixture: _Optional[_Union[Mixture, _Mapping]] = ..., version: _Optional[int] = ..., frozen: _Optional[bool] = ..., field_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Codebook(_message.Message):
    __slots__ = ("schema_version", "backbone_fingerprint", "dims", "version", "entries", "metadata", "base_version", "names")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    backbone_fingerprint: str
    dims: ModelDims
    version: int
    entries: _containers.RepeatedCompositeFieldContainer[ClassEntry]
    metadata: _containers.ScalarMap[str, str]
    base_version: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, schema_version: _Optional[int] = ..., backbone_fingerprint: _Optional[str] = ..., dims: _Optional[_Union[ModelDims, _Mapping]] = ..., version: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[ClassEntry, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., base_version: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class ClientUpdate(_message.Message):
    __slots__ = ("schema_version", "base_version", "phase", "backbone_fingerprint", "dims", "entries", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    base_version: int
    phase: Phase
    backbone_fingerprint: str
    dims: ModelDims
    entries: _containers.RepeatedCompositeFieldContainer[ClassEntry]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, schema_version: _Optional[int] = ..., base_version: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., backbone_fingerprint: _Optional[str] = ..., dims: _Optional[_Union[ModelDims, _Mapping]] = ..., entries: _Optional[_Iterable[_Union[ClassEntry, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ClassScore(_message.Message):
    __slots__ = ("name", "images", "correct", "selection_hits", "taken_by")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    SELECTION_HITS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    images: int
    correct: int
    selection_hits: int
    taken_by: _containers.RepeatedCompositeFieldContainer[ClassCount]
    def __init__(self, name: _Optional[str] = ..., images: _Optional[int] = ..., correct: _Optional[int] = ..., selection_hits: _Optional[int] = ..., taken_by: _Optional[_Iterable[_Union[ClassCount, _Mapping]]] = ...) -> None: ...

class ClassCount(_message.Message):
    __slots__ = ("name", "images")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    images: int
    def __init__(self, name: _Optional[str] = ..., images: _Optional[int] = ...) -> None: ...

class EvaluationReport(_message.Message):
    __slots__ = ("schema_version", "backbone_fingerprint", "codebook_version", "classes", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    backbone_fingerprint: str
    codebook_version: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassScore]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, schema_version: _Optional[int] = ..., backbone_fingerprint: _Optional[str] = ..., codebook_version: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassScore, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
