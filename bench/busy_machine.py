"""Two processes on one machine: does each slow by its share of the cores, or by far more?

Each copy runs the server replay's inner loop at the tiny preset's size (a batch of synthetic
features, a linear head, cross-entropy, an SGD step; ``shared/model/replay.py``) with torch's
default threads (one per core), alone and two copies at once, under each OpenMP wait policy:
unset (libgomp spins a waiting thread before sleeping) and ``PASSIVE`` (it sleeps at once, as
``starfed`` sets it: cli/__init__.py). Conditions are interleaved round by round, so a load
that others put on the machine falls on all of them alike; the load is printed.

    python bench/busy_machine.py                  # 3 rounds of 2000 steps
    python bench/busy_machine.py --rounds 1 --steps 500
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORK = """
import time, torch, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
w = torch.randn(28, 96, requires_grad=True)
y = torch.randint(0, 28, (128,), generator=g)
optimizer = torch.optim.SGD([w], lr=0.001)
start = time.perf_counter()
for _ in range({steps}):
    features = torch.randn(128, 96, generator=g)
    loss = F.cross_entropy(features @ w.t(), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(time.perf_counter() - start)
"""


def copies(n: int, steps: int, policy: str | None) -> list[float]:
    """Walls of ``n`` copies started at once (the loop only, not the interpreter's start)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    command = [sys.executable, "-c", WORK.format(steps=steps)]
    running = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)
    ]
    return [float(p.communicate()[0]) for p in running]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    walls: dict[str, list[float]] = {}
    loads = []
    for _ in range(args.rounds):
        for policy in (None, "PASSIVE"):
            for n in (1, 2):
                loads.append(os.getloadavg()[0])
                key = f"{policy or 'unset'} x{n}"
                walls.setdefault(key, []).extend(copies(n, args.steps, policy))
    medians = {key: statistics.median(values) for key, values in walls.items()}
    for policy in ("unset", "PASSIVE"):
        alone, pair = medians[f"{policy} x1"], medians[f"{policy} x2"]
        print(
            f"OMP_WAIT_POLICY {policy:8}: alone {alone:7.2f} s, two at once {pair:7.2f} s "
            f"each: {pair / alone:5.1f}x"
        )
    print(
        f"# {os.cpu_count()} CPUs, load {min(loads):.1f}-{max(loads):.1f} while measuring, "
        f"{args.steps} steps, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(json.dumps({"median_wall_s": medians, "walls_s": walls}))


if __name__ == "__main__":
    main()
