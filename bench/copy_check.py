"""What the copy check costs a step (``server.copies.copies``), at up to 10,000 classes.

The check runs before the first level's replay in every step that brings a class one site
alone holds: each reference class's mean and spread from its G_c, then one distance per
(lone class, reference) pair. This times it on random mixtures of the paper's CLIP width
(768, three components, counts of 50), every class held by one of seven sites, the step's
lone classes the last ``--lone`` of them (100: ``max-step-classes``, the most a step brings;
an attacker cannot make it more), median of ``--repeats`` runs. The codebook is a stand-in
with the two things the check reads (``names``, and each entry's ``values``/``mixture``):
a real codebook of 10,000 paper-dims classes holds 2 GB of other fields it never touches.

    python bench/copy_check.py                       # 1,000 and 10,000 classes, 100 lone
    python bench/copy_check.py --classes 10000 --lone 1 100
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from starfed.server.copies import FIELD, copies
from starfed.shared.codebook.mixture import GaussianMixture

D_CLIP, COMPONENTS, COUNT, SITES = 768, 3, 50, 7


@dataclass
class Entry:
    """A class with only its G_c."""

    g_c: GaussianMixture
    values: dict = field(init=False)

    def __post_init__(self) -> None:
        self.values = {FIELD: self.g_c}

    def mixture(self, _: str) -> GaussianMixture:
        return self.g_c


class Classes(dict):
    """Name -> ``Entry``, with the codebook's ``names``."""

    @property
    def names(self) -> list[str]:
        return list(self)


def classes(n: int, seed: int = 0) -> Classes:
    generator = torch.Generator().manual_seed(seed)
    out = Classes()
    for i in range(n):
        means = torch.randn(COMPONENTS, D_CLIP, dtype=torch.float64, generator=generator)
        variances = torch.rand(COMPONENTS, D_CLIP, dtype=torch.float64, generator=generator)
        weights = torch.full((COMPONENTS,), 1 / COMPONENTS, dtype=torch.float64)
        out[f"class {i}"] = Entry(GaussianMixture(weights, means, variances + 0.1, COUNT))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--lone", type=int, nargs="+", default=[100])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"load before: {os.getloadavg()[0]:.1f}")
    print("| classes | lone in play | wall s (median) | CPU s (median) |")
    print("|---:|---:|---:|---:|")
    for n in args.classes:
        codebook = classes(n)
        holders = {name: {f"site {i % SITES}"} for i, name in enumerate(codebook)}
        for lone in args.lone:
            in_play = codebook.names[-lone:]
            walls, cpus = [], []
            for _ in range(args.repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                found = copies(codebook, in_play, holders)  # type: ignore[arg-type]
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            assert not found  # random classes are no copies
            wall_s, cpu_s = statistics.median(walls), statistics.median(cpus)
            print(f"| {n} | {lone} | {wall_s:.3f} | {cpu_s:.3f} |")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
