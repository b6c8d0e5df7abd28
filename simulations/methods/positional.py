"""`starfed-positional`: STAR-Prompt whose trained tensors are averaged by position, as plain
FedAvg averages them, instead of class by class: what the codebook's per-class merge buys.

Plain FedAvg (Flower's ``aggregate_arrayrecords``, the reduction inside its ``FedAvg``)
averages every array over the round's sites, weighted by their examples. Every site holds every
class's rows; a site without images of a class returns them as it was sent them, and they still
count with the site's weight, so a class's training is diluted by the examples held elsewhere.
starfed averages a class only over the sites that carry it (docs/design.md#the-codebook).
Everything else — sync, statistics and their mixture merge, both replays, evaluation — is
starfed's: only the two training reducers are swapped (``starfed.simulations.methods.reducers``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from rich.console import Console

from starfed.server.coordinator import Coordinator, StepFailed
from starfed.server.messaging import Reply
from starfed.shared.codebook import schema
from starfed.shared.config import Values
from starfed.shared.protocol import Phase
from starfed.simulations.methods.reducers import run_with

WEIGHT = "num-examples"  # FedAvg's default weighting key


def merge_by_position(
    coordinator: Coordinator, phase: Phase, step: int, replies: list[Reply]
) -> None:
    """FedAvg over the classes in play: each reply becomes the full array set a plain FedAvg
    client would return (the broadcast rows of the classes it did not train), weighted by the
    examples it trained on. Classes' counts are those of the per-class merge."""
    codebook, fields = coordinator.codebook, schema.trained_in(phase)
    in_play = [name for name in coordinator.in_play if not codebook[name].frozen]
    records, counts = [], {}
    for _, update in coordinator._updates(replies, phase):  # decoded = validated
        trained = {entry.name: entry for entry in update.entries}
        arrays = {
            f"{name}/{f}": Array(
                (trained[name] if name in trained else codebook[name]).values[f].numpy()
            )
            for name in in_play
            for f in fields
        }
        for entry in update.entries:
            counts[entry.name] = counts.get(entry.name, 0) + entry.count
        examples = sum(entry.count for entry in update.entries)
        records.append(
            RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({WEIGHT: examples})})
        )
    if not counts:
        raise StepFailed(f"no site's {phase.key} update arrived for any class in play")
    merged = aggregate_arrayrecords(records, WEIGHT)
    values = {
        name: {f: torch.from_numpy(merged[f"{name}/{f}"].numpy()).float() for f in fields}
        for name in in_play
    }
    coordinator.codebook = codebook.set_values(values, counts)


def run(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    by_position = dict.fromkeys((Phase.STAGE1, Phase.STAGE2), merge_by_position)
    run_with(by_position, values, seed, out_dir, console)
