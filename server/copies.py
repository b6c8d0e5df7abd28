"""Copied classes: a class one site alone brings whose first-level statistics are another's.

A site can bring, under new names, the images of a class another site holds (issue 43, attack
5: farm-m's ten classes made of farm-a's A1 images). Each such class is trained and replayed as
a class of its own and takes the images of the class it copies — A1's test images went to the
copies — with statistics no bound can fault: they are real ones. What gives them away is that
they are *the same* statistics: a class's G_c is fitted on frozen CLIP features of its images,
so the same images give the same mixture, while two different samples of one class differ by
their sampling noise. ``copies`` names the class in play that one site alone holds whose G_c's
mean lies nearer the mean of a class that site does not hold than a quarter of what two
samples of one class differ by (``COPY_BOUND``): nearer than any two fits of different images
come, whatever the backbone. The coordinator leaves each out of the step with a finding
against its site, as a class without statistics is.

The distance: ``‖μ_c − μ_k‖ / (s_k √(1/n_c + 1/n_k))``, the means' distance in units of its
standard error when both are samples of class k — ``s_k`` the spread of k's features
(``GaussianMixture.deviation``), ``n`` each class's count — about 1 for two samples of one class,
0 for the same images. The scale is the other class's, never the checked site's own claim (no
site its own judge); the checked class's count is held to what its site showed at the sync.

What it does not see: a copy whose statistics were moved by more than the bound (edited
replies: then it lies as near the class as another sample of it would, which an honest new
class can too at the tiny preset — docs/security.md, §1c, attack 5, measures what that costs),
and a copy brought in the same step as the class it copies when both are lone (nothing tells
which is the copy: only classes held by two or more sites, or registered before the step, are
the reference).

Cost: none in a step without a lone class in play; else each reference class's mean and
spread, O(classes × components × d_clip), and one distance per pair, O(lone × classes ×
d_clip), one matrix product: at 10,000 classes of the paper's CLIP width (768) and the 100
classes a step may bring, 1.1 s wall, 0.84 CPU-s (docs/benchmarks.md, `bench/copy_check.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch

from starfed.shared.codebook.codebook import Codebook

#: How near, in standard errors of the means' difference, a lone class's G_c may lie to another
#: site's class. Two fits of the same images: 0.000 (tests/test_adversarial_alone.py's copies);
#: two samples of one class about 1 (below 0.4 with under a 10⁻³ chance even at 10 effective
#: dimensions); honest distinct classes at least 0.76 in the attack tests' federations and 1.49
#: in the default simulation's codebook (random tiny backbones, where classes overlap most).
COPY_BOUND = 0.25
FIELD = "clip_mixture"


@dataclass(frozen=True)
class Copy:
    """A lone class whose G_c lies within ``COPY_BOUND`` of the G_c of a class its one holder
    does not hold."""

    name: str  # the lone class
    site: str  # its one holder
    other: str  # the class whose statistics it has
    distance: float

    @property
    def reason(self) -> str:
        return (
            f"its first-level statistics are those of {self.other[:60]!r}, a class {self.site} "
            f"does not hold (distance {self.distance:.3f} standard errors, under "
            f"{COPY_BOUND}: the same images under another name): left out of the step"
        )


def copies(
    codebook: Codebook,
    in_play: Iterable[str],
    holders: Mapping[str, Collection[str]],
) -> list[Copy]:
    """The classes in play that one site alone holds (``holders``: the registry's) whose G_c
    lies within ``COPY_BOUND`` of a reference class's: one that site does not hold, held by two
    or more sites or not in play (see the module's docstring)."""
    playing = set(in_play)
    lone = sorted(
        n for n in playing if len(holders.get(n, ())) == 1 and FIELD in codebook[n].values
    )
    if not lone:
        return []
    references = [
        name
        for name in codebook.names
        if FIELD in codebook[name].values
        and (name not in playing or len(holders.get(name, ())) > 1)
    ]
    if not references:
        return []
    mixtures = [codebook[name].mixture(FIELD) for name in references]
    means = torch.stack([m.mean() for m in mixtures])  # [K, D]
    scales = torch.stack([m.deviation() for m in mixtures])
    counts = torch.tensor([m.count for m in mixtures], dtype=torch.float64).clamp_min(1)
    checked = [codebook[name].mixture(FIELD) for name in lone]
    mine = torch.stack([m.mean() for m in checked])  # [L, D]
    mine_counts = torch.tensor([m.count for m in checked], dtype=torch.float64).clamp_min(1)
    # ‖a − b‖² as ‖a‖² + ‖b‖² − 2a·b: one product for every pair; the nearest pair's distance
    # is then taken again exactly (a copy's is 0, not the expansion's rounding)
    squared = (mine**2).sum(1, keepdim=True) + (means**2).sum(1) - 2 * mine @ means.T
    error = scales * (1 / mine_counts[:, None] + 1 / counts).sqrt()  # [L, K]
    distance = squared.clamp_min(0).sqrt() / error.clamp_min(1e-300)
    site_of = {name: next(iter(holders[name])) for name in lone}
    others = {  # per checked site, the references it does not hold
        site: torch.tensor([site not in holders.get(r, ()) for r in references])
        for site in set(site_of.values())
    }
    found = []
    for row, name in enumerate(lone):
        theirs = others[site_of[name]]
        if not bool(theirs.any()):
            continue
        best = int(distance[row].masked_fill(~theirs, torch.inf).argmin())
        exact = float((means[best] - mine[row]).norm() / error[row, best].clamp_min(1e-300))
        if exact < COPY_BOUND:
            found.append(Copy(name, site_of[name], references[best], exact))
    return found
