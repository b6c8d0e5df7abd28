"""Server merge at scale: N site updates × C classes at the paper's dims, time and peak memory.

The coordinator takes a phase's replies in the order of site names, decodes (= validates) each
one and measures its rows for the screening (``server.screening``: first pass), sets the
screening's bounds, then screens each decoded update and adds it to a ``MergeAccumulator``
(second pass; docs/design.md#the-codebook); with ``merge = median`` (the default) the screened
updates are held and merged at the phase's end (``server.robust.MedianStrategy``: the
coordinate-wise median of each class held by three or more sites). This measures both merges,
interleaved, for a training phase (stage 2: Q, A and head rows) and a statistics phase
(stage2_stats: ViT mixtures, which the median merges as the mean), each case in a fresh process
so that its peak RSS is its own, against the time of copying the same replies' bytes once (each
into a new buffer), measured in the same process: ``merge ÷ copy`` is the merge's wall time over
the copy's (its CPU time over the copy's in parentheses: on a shared machine the steadier one),
``total ÷ copy`` the whole phase's (decode and screening included). Updates are
random, every site carries every class; they are generated before the timings and held, as a
server holds the replies it pulled: the peak is what the phase adds to them.

    python bench/merge_scale.py                          # 10, 100, 1000 sites; median of 3 runs
    python bench/merge_scale.py --sites 10,100 --runs 1 --phases stage2 --merges median
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from codebook_sizes import PAPER, parse_dims, random_codebook, random_mixture

from starfed.server.decode import without_cyclic_gc
from starfed.server.field_bounds import PhaseScreen
from starfed.server.records import Exchange
from starfed.server.robust import MIN_HOLDERS, MedianStrategy, SiteStack
from starfed.server.screening import Screen, ScreeningOptions
from starfed.server.strategy import PhaseState
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import Phase

PHASES = {"stage2": Phase.STAGE2, "stage2_stats": Phase.STAGE2_STATS}
MERGES = ("mean", "median")
PARTS = ("decode", "screen", "merge")
COLUMNS = ("decode", "screen", "merge", "total", "copy")


def site_update(codebook: Codebook, phase: Phase, site: int, n_components: int) -> bytes:
    """One site's reply for ``phase``: random rows for every class, counts 1..199."""
    generator = torch.Generator().manual_seed(10_000 + site)
    entries = []
    for name in codebook.names:
        count = int(torch.randint(1, 200, (), generator=generator))
        values = {}
        for field_name in schema.trained_in(phase):
            f = schema.BY_NAME[field_name]
            shape = f.shape(codebook.dims)
            if f.kind is schema.Kind.TENSOR:
                values[field_name] = torch.randn(shape, generator=generator)
            else:
                mixture = random_mixture(shape[0], n_components, generator)
                values[field_name] = dataclasses.replace(mixture, count=count)
        entries.append(ClassEntry(name, count, values))
    update = ClientUpdate(codebook.fingerprint, codebook.dims, phase, codebook.version, entries)
    return wire.encode(update)


def site_name(site: int) -> str:
    return f"site-{site:04d}"


def synced(codebook: Codebook, sites: int) -> Screen:
    """The step's screening with every site synced, each reporting the most examples an
    update of ``site_update`` can claim for every class."""
    sync = ClientUpdate(
        codebook.fingerprint,
        codebook.dims,
        Phase.SYNC,
        0,
        [ClassEntry(name, 10**6) for name in codebook.names],
    )
    # random rows move a class by about its own scale, and a random bias near 0 by over
    # ``reference-bound`` × its size: that bound is left out, the others kept
    screen = Screen(ScreeningOptions(reference_bound=0.0), step=0)
    accepted = [(Exchange(0, "sync", 0, i + 1, site_name(i), 0), sync) for i in range(sites)]
    screen.sync(accepted, codebook, {})
    return screen


def decode(data: bytes, codebook: Codebook, phase: Phase) -> ClientUpdate:
    return wire.decode_update(data, against=codebook, phase=phase)


def memory_mb(key: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in MB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def copy_once(replies: list[bytes]) -> None:
    """Each reply's bytes copied once into a new buffer: what the merge is measured against."""
    for data in replies:
        copy = bytearray(data)
        del copy


def run_case(
    phase: Phase, sites: int, merge_name: str, classes: int, n_components: int, dims
) -> dict:
    """One merge, timed by part, with the peak RSS above what the process held before it (the
    replies included), and the copy of the replies' bytes. The mean streams the screened updates
    into a ``MergeAccumulator``; the median holds them and merges at the end."""
    codebook = random_codebook(dims, classes, n_components)
    warm_up = MergeAccumulator(codebook, n_components=n_components)  # imports, thread pools
    warm_up.add(
        wire.decode_update(
            site_update(codebook, phase, -1, n_components), against=codebook, phase=phase
        )
    )
    warm_up.result()
    del warm_up
    SiteStack().median([torch.zeros(3)] * MIN_HOLDERS)  # a process's first median: its kernel
    replies = [site_update(codebook, phase, site, n_components) for site in range(sites)]
    wall = dict.fromkeys(PARTS, 0.0)
    cpu = dict.fromkeys(PARTS, 0.0)

    def timed(part: str, work, *args):
        w0, c0 = time.perf_counter(), time.process_time()
        out = work(*args)
        wall[part] += time.perf_counter() - w0
        cpu[part] += time.process_time() - c0
        return out

    w0, c0 = time.perf_counter(), time.process_time()
    copy_once(replies)
    copy_s, copy_cpu = time.perf_counter() - w0, time.process_time() - c0
    before = memory_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    screen = synced(codebook, sites)
    merge = MergeAccumulator(codebook, n_components=n_components)
    phase_screen = timed("screen", PhaseScreen, screen, phase, 0, codebook)
    updates = []  # views of the replies' bytes: held between the passes, as the coordinator does
    with without_cyclic_gc():
        for site, data in enumerate(replies):  # in the order of site names: site-0000, site-0001
            update = timed("decode", decode, data, codebook, phase)
            timed("screen", phase_screen.observe, site_name(site), update)
            updates.append(update)
    timed("screen", phase_screen.decide)
    screened = []
    for site, update in enumerate(updates):
        kept = timed("screen", phase_screen.apply, site_name(site), update)
        if merge_name == "mean":
            timed("merge", merge.add, kept)
        else:
            screened.append(kept)
    del updates, update, kept
    if merge_name == "mean":
        timed("merge", merge.result)
    else:
        # the strategy's hook, as the coordinator calls it (a merge reads the codebook and M)
        train = TrainConfig(mixture_components=n_components)
        state = PhaseState(0, 0, codebook, tuple(codebook.names), {}, None, train)
        timed("merge", MedianStrategy.merge, screened, state)
    del screened
    assert not screen.findings, screen.findings[:3]  # random rows of one scale: none is out
    times = {f"{part}_s": wall[part] for part in PARTS} | {
        f"{part}_cpu": cpu[part] for part in PARTS
    }
    times["total_s"], times["total_cpu"] = sum(wall.values()), sum(cpu.values())
    times["copy_s"], times["copy_cpu"] = copy_s, copy_cpu
    return {
        **times,
        "ratio": times["total_s"] / copy_s,
        "merge_ratio": times["merge_s"] / copy_s,
        "merge_cpu_ratio": times["merge_cpu"] / copy_cpu,
        "peak_mb": memory_mb("VmHWM") - before,
        # the median's state is the held updates and one field of one class, stacked
        "state_mb": merge.nbytes / 2**20 if merge_name == "mean" else float("nan"),
        "replies_mb": sum(map(len, replies)) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="10,100,1000", help="comma-separated site counts")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    parser.add_argument("--merges", default=",".join(MERGES), help=f"of {', '.join(MERGES)}")
    parser.add_argument("--classes", type=int, default=35, help="classes every site carries")
    parser.add_argument("--components", type=int, default=5, help="mixture components M")
    parser.add_argument("--dims", type=parse_dims, default=PAPER, help="d_txt,d_clip,d_vit,L")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per case (median)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # PHASE:SITES:MERGE, in a child
    args = parser.parse_args()
    if args.case:
        phase, sites, merge_name = args.case.split(":")
        result = run_case(
            PHASES[phase], int(sites), merge_name, args.classes, args.components, args.dims
        )
        print(json.dumps(result))
        return
    d = args.dims
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}; dims {d.d_txt},{d.d_clip},{d.d_vit},{d.n_layers}, "
        f"{args.classes} classes per update, M={args.components}, "
        f"median of {args.runs} runs"
    )
    print(
        "| merge | phase | sites | replies MB | decode s | screen s | merge s | total s | copy s | "
        "merge ÷ copy | total ÷ copy | peak RSS MB | state MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [
        (phase, sites, merge_name)
        for phase in args.phases.split(",")
        for sites in (int(n) for n in args.sites.split(","))
        for merge_name in args.merges.split(",")  # interleaved: the same load for both
    ]
    for phase, sites, merge_name in cases:
        command = [
            sys.executable,
            __file__,
            "--case",
            f"{phase}:{sites}:{merge_name}",
            "--classes",
            str(args.classes),
            "--components",
            str(args.components),
            "--dims",
            f"{d.d_txt},{d.d_clip},{d.d_vit},{d.n_layers}",
        ]
        runs = [
            json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            for _ in range(args.runs)
        ]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        times = [f"{median[f'{c}_s']:.2f} ({median[f'{c}_cpu']:.2f})" for c in COLUMNS]
        print(
            f"| {merge_name} | {phase} | {sites} | {median['replies_mb']:.0f} | "
            f"{' | '.join(times)} | {median['merge_ratio']:.1f} "
            f"({median['merge_cpu_ratio']:.1f}) | {median['ratio']:.1f} | "
            f"{median['peak_mb']:.0f} | {median['state_mb']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
