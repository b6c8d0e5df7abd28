"""What one DP-SGD step's per-image gradients cost: ``unit_gradients`` (``vmap`` of ``grad``)
against the loop it replaced (one ``autograd.grad`` per image) and one batched backward.

Stage 2's loss (the prompted ViT, tiny preset) on ``--images`` random images of two classes:
each image its own unit, as the per-image unit takes them. The loop's and ``vmap``'s gradients
must agree to float32 rounding (the largest relative difference is printed).

    python bench/dp_sgd_gradients.py --images 128
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from starfed.shared.data.images import augment_each
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.features import Views
from starfed.shared.model.losses import masked_cross_entropy
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import StepLoss, unit_gradients


def stage2_loss(model: StarPrompt, images: torch.Tensor, labels: torch.Tensor) -> StepLoss:
    """Stage 2's loss of the model's two classes (no past classes), views drawn per image."""
    views = Views.of(model.backbones)
    trained = {n: model.bank[n].clone() for n in ("query_weight", "query_prompt")}
    trained |= {n: model.bank[n].clone() for n in ("head_weight", "head_bias")}

    def inputs(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vit_in, clip_in = views.pair(augment_each(images[batch], 0))
        return vit_in, model.backbones.clip_image_features(clip_in), labels[batch]

    def of(
        at: dict[str, torch.Tensor], vit_in: torch.Tensor, z: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        out = model.second_level(vit_in, z, at["query_weight"], at["query_prompt"])
        logits = F.linear(out.features, at["head_weight"], at["head_bias"])
        return masked_cross_entropy(logits, targets, 0)

    return StepLoss(trained, inputs, of)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=128, help="images a step takes")
    args = parser.parse_args(argv)
    model = StarPrompt(create_backbones("tiny", seed=0))
    model.add_classes(["Apple___healthy", "Corn___healthy"], seed=0)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.images, 3, 64, 64), dtype=torch.uint8, generator=generator)
    loss = stage2_loss(model, images, torch.arange(args.images) % 2)
    every = torch.arange(args.images)

    start = time.perf_counter()
    batched = unit_gradients(loss, every, every, args.images)
    vmapped = time.perf_counter() - start

    params = {n: t.clone().requires_grad_(True) for n, t in loss.trained.items()}
    start = time.perf_counter()
    worst = 0.0
    for i in range(args.images):
        one = torch.autograd.grad(
            loss.of(params, *loss.inputs(every[i : i + 1])), [*params.values()]
        )
        for g, b in zip(one, batched, strict=True):
            worst = max(worst, float((g - b[i]).abs().max() / g.abs().max().clamp_min(1e-30)))
    looped = time.perf_counter() - start

    start = time.perf_counter()
    torch.autograd.grad(loss.of(params, *loss.inputs(every)), [*params.values()])
    once = time.perf_counter() - start
    print(
        f"{args.images} images: vmap {vmapped:.1f} s, loop {looped:.1f} s, one batch {once:.1f} s"
    )
    print(f"largest relative difference, loop against vmap: {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
