"""The per-class schema: every field a class entry holds, in one table.

Everything that handles per-class state is derived from ``FIELDS``: the class bank's columns,
the protobuf conversion (each field is the ``ClassEntry`` message field of the same name), decode
validation, ``starfed codebook inspect``, merging, the fields each phase's update carries and what
a broadcast leaves out. Adding a per-class parameter is one line here (plus its protobuf field and
the code that trains it); see docs/design.md#the-codebook.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from starfed.shared.protocol import Phase


@dataclass(frozen=True)
class ModelDims:
    """Sizes the per-class tensors depend on (fixed by the frozen backbone pair)."""

    d_txt: int  # CLIP text width
    d_clip: int  # CLIP joint embedding size
    d_vit: int  # ViT width
    n_layers: int  # ViT blocks, all prompted


class Kind(enum.Enum):
    TENSOR = "tensor"  # float32 in memory; the run's wire dtype (float32 or float16) on the wire
    MIXTURE = "mixture"  # GaussianMixture, float64 in memory and on the wire (statistics merge)


@dataclass(frozen=True)
class Field:
    """One per-class field."""

    name: str  # the one name: bank column, entry key, protobuf field, logs
    symbol: str  # the paper's symbol
    kind: Kind
    shape: Callable[[ModelDims], tuple[int, ...]]  # a tensor row's shape, or (feature dim,)
    trained_in: Phase | None  # the phase whose site update carries it; None: server-computed
    broadcast: bool  # sent to sites; False: server-only replay memory
    doc: str


FIELDS: tuple[Field, ...] = (
    Field(
        "prompt",
        "p_c",
        Kind.TENSOR,
        lambda d: (d.d_txt,),
        Phase.STAGE1,
        True,
        "first-level prompt token in CLIP's text encoder",
    ),
    Field(
        "key",
        "w_c",
        Kind.TENSOR,
        lambda d: (d.d_clip,),
        None,
        True,
        "first-level key, computed from p_c after replay and then frozen",
    ),
    Field(
        "query_prompt",
        "Q_c",
        Kind.TENSOR,
        lambda d: (d.n_layers, d.d_vit),
        Phase.STAGE2,
        True,
        "second-level prompt, one vector per ViT block",
    ),
    Field(
        "query_weight",
        "A_c",
        Kind.TENSOR,
        lambda d: (d.n_layers, d.d_clip),
        Phase.STAGE2,
        True,
        "query weighting, one vector per ViT block",
    ),
    Field(
        "head_weight",
        "θ_c",
        Kind.TENSOR,
        lambda d: (d.d_vit,),
        Phase.STAGE2,
        True,
        "head row trained on real data (the next task resumes from it)",
    ),
    Field(
        "head_bias",
        "b_c",
        Kind.TENSOR,
        lambda d: (),
        Phase.STAGE2,
        True,
        "head bias trained on real data",
    ),
    Field(
        "aligned_head_weight",
        "θ̂_c",
        Kind.TENSOR,
        lambda d: (d.d_vit,),
        None,
        True,
        "head row after replay alignment, used to predict",
    ),
    Field(
        "aligned_head_bias",
        "b̂_c",
        Kind.TENSOR,
        lambda d: (),
        None,
        True,
        "head bias after replay alignment",
    ),
    Field(
        "clip_mixture",
        "G_c",
        Kind.MIXTURE,
        lambda d: (d.d_clip,),
        Phase.STAGE1_STATS,
        False,
        "mixture of Gaussians over CLIP image features",
    ),
    Field(
        "vit_mixture",
        "H_c",
        Kind.MIXTURE,
        lambda d: (d.d_vit,),
        Phase.STAGE2_STATS,
        False,
        "mixture of Gaussians over final-LN ViT CLS features",
    ),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
TENSORS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.kind is Kind.TENSOR)
MIXTURES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.kind is Kind.MIXTURE)
BROADCAST: tuple[str, ...] = tuple(f.name for f in FIELDS if f.broadcast)


def trained_in(phase: Phase) -> tuple[str, ...]:
    """The fields a site's update for ``phase`` carries (none for sync and evaluate)."""
    return tuple(f.name for f in FIELDS if f.trained_in is phase)
