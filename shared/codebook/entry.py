"""The per-class learned state of the two-level model, stacked by class.

Row ``i`` of every tensor belongs to ``names[i]``. The model computes with stacked tensors (one
matmul over all classes instead of a loop); the codebook stores the
same rows one class entry at a time. Classes are appended, never removed or reordered, so a row
index is stable for the life of a bank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from starfed.shared.codebook.mixture import GaussianMixture


@dataclass(frozen=True)
class ModelDims:
    """Sizes the per-class tensors depend on (fixed by the backbone pair)."""

    d_txt: int  # CLIP text width (size of p_c)
    d_clip: int  # CLIP joint embedding size (keys, A_c rows, G_c)
    d_vit: int  # ViT width (Q_c rows, head rows, H_c)
    n_layers: int  # ViT blocks, all prompted


@dataclass
class ClassBank:
    """Everything learned per class, as stacked float32 tensors plus the replay mixtures."""

    dims: ModelDims
    names: list[str] = field(default_factory=list)
    prompts: torch.Tensor | None = None  # p:  [C, d_txt]
    keys: torch.Tensor | None = None  # w:  [C, d_clip] (L2-normalised, frozen after stage 1)
    query_prompts: torch.Tensor | None = None  # Q:  [C, L, d_vit]
    query_weights: torch.Tensor | None = None  # A:  [C, L, d_clip]
    head_weight: torch.Tensor | None = None  # θ trained on real data: [C, d_vit]
    head_bias: torch.Tensor | None = None  # [C]
    aligned_head_weight: torch.Tensor | None = None  # θ after replay alignment: [C, d_vit]
    aligned_head_bias: torch.Tensor | None = None  # [C]
    clip_mixtures: list[GaussianMixture | None] = field(default_factory=list)  # G_c
    vit_mixtures: list[GaussianMixture | None] = field(default_factory=list)  # H_c
    counts: list[int] = field(default_factory=list)  # training examples seen per class
    versions: list[int] = field(default_factory=list)  # model version each row was last set at

    def __post_init__(self) -> None:
        d = self.dims
        empty = {
            "prompts": (0, d.d_txt),
            "keys": (0, d.d_clip),
            "query_prompts": (0, d.n_layers, d.d_vit),
            "query_weights": (0, d.n_layers, d.d_clip),
            "head_weight": (0, d.d_vit),
            "head_bias": (0,),
            "aligned_head_weight": (0, d.d_vit),
            "aligned_head_bias": (0,),
        }
        for name, shape in empty.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape))

    TENSOR_FIELDS = (
        "prompts",
        "keys",
        "query_prompts",
        "query_weights",
        "head_weight",
        "head_bias",
        "aligned_head_weight",
        "aligned_head_bias",
    )

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def append(self, names: list[str], rows: dict[str, torch.Tensor], version: int = 0) -> None:
        """Add new classes; ``rows`` gives every tensor field for them (first dim = len(names))."""
        duplicate = set(names) & set(self.names)
        if duplicate or len(set(names)) != len(names):
            raise ValueError(f"classes already in the bank or repeated: {sorted(duplicate)}")
        missing = set(self.TENSOR_FIELDS) - set(rows)
        if missing:
            raise ValueError(f"missing per-class tensors: {sorted(missing)}")
        for name in self.TENSOR_FIELDS:
            value = rows[name].detach().to(torch.float32)
            current = getattr(self, name)
            if value.shape[0] != len(names) or value.shape[1:] != current.shape[1:]:
                raise ValueError(
                    f"{name}: expected shape {(len(names), *current.shape[1:])}, "
                    f"got {tuple(value.shape)}"
                )
            setattr(self, name, torch.cat([current, value]))
        self.names.extend(names)
        self.clip_mixtures.extend([None] * len(names))
        self.vit_mixtures.extend([None] * len(names))
        self.counts.extend([0] * len(names))
        self.versions.extend([version] * len(names))

    def set_rows(self, field_name: str, start: int, value: torch.Tensor) -> None:
        """Overwrite rows ``start : start + len(value)`` of one tensor field."""
        target = getattr(self, field_name)
        target[start : start + value.shape[0]] = value.detach().to(target.dtype)

    def select(self, names: list[str]) -> ClassBank:
        """A new bank holding copies of the rows of ``names``, in that order."""
        rows = [self.index(name) for name in names]
        picked = ClassBank(self.dims)
        index = torch.tensor(rows, dtype=torch.long)
        picked.append(list(names), {f: getattr(self, f)[index].clone() for f in self.TENSOR_FIELDS})
        picked.clip_mixtures = [self.clip_mixtures[r] for r in rows]
        picked.vit_mixtures = [self.vit_mixtures[r] for r in rows]
        picked.counts = [self.counts[r] for r in rows]
        picked.versions = [self.versions[r] for r in rows]
        return picked
