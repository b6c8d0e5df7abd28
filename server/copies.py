"""Copied classes: a class one site alone brings whose first-level statistics are another's.

A site can bring, under new names, the images of a class another site holds (issue 43, attack
5: farm-m's ten classes made of farm-a's A1 images). Each such class is trained and replayed as
a class of its own and takes the images of the class it copies — A1's test images went to the
copies — with statistics no bound can fault: they are real ones. What gives them away is that
they are *the same* statistics: a class's G_c is fitted on frozen CLIP features of its images,
so the same images give the same mixture, while two different samples of one class differ by
their sampling noise. ``copies`` names the class in play that one site alone holds whose G_c's
mean lies nearer the mean of another class than ``COPY_BOUND`` standard errors: nearer than two
fits of different images come. The other class is any class of the codebook but a lone class
another site brings in the same step (nothing tells which of two such is the copy): another
site's, and the checked site's own too — ten classes of the same images under ten names are
each a copy of the others (attack 5's aimed variant: ten classes of A1's other images). The
coordinator leaves each out of the step with a finding against its site, as a class without
statistics is.

The distance: ``‖μ_c − μ_k‖ / (s_k √(1/n_c + 1/n_k))``, the means' distance in units of its
standard error when both are samples of class k — ``s_k`` the spread of k's features
(``GaussianMixture.deviation``), ``n`` each class's count — 0 for the same images. The scale is
the other class's, never the checked class's own claim (no site its own judge); the checked
class's count is held to what its site showed at the sync.

What it does not see: classes of *other* images of a class (farm-m's ten classes each of
different images of A1's class: docs/security.md, §1c, attack 5, measures what they cost) —
at the tiny preset such a class lies 0.45 standard errors from A1, where two honest distinct
classes come as near as 0.67 (below); a copy whose statistics were moved past the bound (edited
replies); a copy brought in the same step as the class it copies when both are lone.

Cost: none in a step without a lone class in play; else each class's mean and spread,
O(classes × components × d_clip), and one distance per pair, O(lone × classes × d_clip), one
matrix product: at 10,000 classes of the paper's CLIP width (768) and the 100 classes a step
may bring, 0.66 s wall, 0.76 CPU-s (idle) (docs/benchmarks.md, `bench/copy_check.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch

from starfed.shared.codebook.codebook import Codebook

#: How near, in standard errors of the means' difference, a lone class's G_c may lie to another
#: class's. The same images: 0.000 (tests/test_adversarial_alone.py's copies); other images of
#: one class: 0.45 (A1's training images 12-23 against its 0-11, tiny preset); honest distinct
#: classes at least 0.67 in the attack tests' federations (two maize diseases) and 1.36 in the
#: default simulation's codebook (random tiny backbones, where classes overlap most).
COPY_BOUND = 0.25
FIELD = "clip_mixture"


@dataclass(frozen=True)
class Copy:
    """A lone class whose G_c lies within ``COPY_BOUND`` of the G_c of another class."""

    name: str  # the lone class
    site: str  # its one holder
    other: str  # the class whose statistics it has
    holders: tuple[str, ...]  # the sites that brought ``other``
    distance: float

    @property
    def reason(self) -> str:
        return (
            f"its first-level statistics are those of {self.other[:60]!r} (brought by "
            f"{', '.join(self.holders)}): the same images under another name (distance "
            f"{self.distance:.3f} standard errors, under {COPY_BOUND}): left out of the step"
        )


def copies(
    codebook: Codebook,
    in_play: Iterable[str],
    holders: Mapping[str, Collection[str]],
) -> list[Copy]:
    """The classes in play that one site alone holds (``holders``: the registry's) whose G_c
    lies within ``COPY_BOUND`` of another class's: any but a lone class of another site in play
    (see the module's docstring)."""
    playing = set(in_play)
    site_of = {
        name: next(iter(holders[name]))
        for name in playing
        if len(holders.get(name, ())) == 1 and FIELD in codebook[name].values
    }
    if not site_of:
        return []
    names = [name for name in codebook.names if FIELD in codebook[name].values]
    index = {name: i for i, name in enumerate(names)}
    mixtures = [codebook[name].mixture(FIELD) for name in names]
    means = torch.stack([m.mean() for m in mixtures])  # [K, D]
    scales = torch.stack([m.deviation() for m in mixtures])
    counts = torch.tensor([m.count for m in mixtures], dtype=torch.float64).clamp_min(1)
    lone = sorted(site_of)
    rows = torch.tensor([index[name] for name in lone])
    mine = means[rows]  # [L, D]
    error = (scales * (1 / counts[rows, None] + 1 / counts).sqrt()).clamp_min(1e-300)  # [L, K]
    # every pair at once (cdist: one matrix product); the nearest pair's distance is then taken
    # again exactly (a copy's is 0, not the product's rounding)
    distance = torch.cdist(mine, means) / error
    usable = {  # per checked site, the classes it may be a copy of
        site: torch.tensor([site_of.get(n, site) == site for n in names])
        for site in set(site_of.values())
    }
    found = []
    for row, name in enumerate(lone):
        mask = usable[site_of[name]].clone()
        mask[index[name]] = False
        if not bool(mask.any()):
            continue
        best = int(distance[row].masked_fill(~mask, torch.inf).argmin())
        exact = float((means[best] - mine[row]).norm() / error[row, best])
        if exact < COPY_BOUND:
            other = names[best]
            theirs = tuple(sorted(holders.get(other, ())))
            found.append(Copy(name, site_of[name], other, theirs, exact))
    return found
