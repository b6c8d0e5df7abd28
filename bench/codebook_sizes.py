"""How many bytes a class entry and a whole codebook take, measured by serialising random ones.

What a site uploads and the server broadcasts is a codebook, so its size is the communication
cost of starfed; full ViT-B/16 weights are printed for comparison.

    python bench/codebook_sizes.py                        # paper dims and a tiny example
    python bench/codebook_sizes.py --dims 64,64,96,3      # d_txt,d_clip,d_vit,n_layers
"""

from __future__ import annotations

import argparse

import torch

from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims

PAPER = ModelDims(d_txt=768, d_clip=768, d_vit=768, n_layers=12)
TINY = ModelDims(d_txt=64, d_clip=64, d_vit=96, n_layers=3)
VIT_B16_PARAMS = 86.6e6


def parse_dims(text: str) -> ModelDims:
    d_txt, d_clip, d_vit, n_layers = (int(v) for v in text.split(","))
    return ModelDims(d_txt, d_clip, d_vit, n_layers)


def random_mixture(dim: int, n_components: int, generator: torch.Generator) -> GaussianMixture:
    weights = torch.rand(n_components, dtype=torch.float64, generator=generator) + 0.1
    return GaussianMixture(
        weights=weights / weights.sum(),
        means=torch.randn(n_components, dim, dtype=torch.float64, generator=generator),
        variances=torch.rand(n_components, dim, dtype=torch.float64, generator=generator) + 0.1,
        count=100,
    )


def random_codebook(dims: ModelDims, n_classes: int, n_components: int) -> Codebook:
    """Random values: float32 bytes do not compress, so sizes match trained codebooks."""
    generator = torch.Generator().manual_seed(0)
    entries = {}
    for i in range(n_classes):
        values = {
            f.name: torch.randn(f.shape(dims), generator=generator)
            if f.kind is schema.Kind.TENSOR
            else random_mixture(f.shape(dims)[0], n_components, generator)
            for f in schema.FIELDS
        }
        name = f"class_{i:02d}"
        entries[name] = ClassEntry(name, 100, values)
    return Codebook("0" * 64, dims, entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dims",
        type=parse_dims,
        action="append",
        help="d_txt,d_clip,d_vit,n_layers (repeatable; default: paper and tiny)",
    )
    parser.add_argument("--classes", type=int, default=35, help="classes in the codebook")
    parser.add_argument("--components", type=int, default=5, help="mixture components M")
    args = parser.parse_args()
    dims_list = args.dims or [PAPER, TINY]

    header = f"{'dims (d_txt,d_clip,d_vit,L)':<28} {'dtype':<8} {'what':<22}"
    print(f"{header} {'entry':>12} {'codebook':>14}")
    for dims in dims_list:
        full = random_codebook(dims, args.classes, args.components)
        label = f"{dims.d_txt},{dims.d_clip},{dims.d_vit},{dims.n_layers}"
        # the broadcast (what sites download) leaves the server-only mixtures out
        for what, codebook in (("with mixtures", full), ("broadcast", full.without_mixtures())):
            for dtype in ("float32", "float16"):
                entry = wire.to_proto(codebook, dtype).entries[0].ByteSize()
                total = len(wire.encode(codebook, dtype))
                row = f"{label:<28} {dtype:<8} {what:<22}"
                print(f"{row} {entry:>12,} {total:>14,}  ({args.classes} classes)")
    vit_bytes = VIT_B16_PARAMS * 4
    print(f"full ViT-B/16 weights, float32: {vit_bytes:,.0f} bytes (86.6M parameters x 4)")


if __name__ == "__main__":
    main()
