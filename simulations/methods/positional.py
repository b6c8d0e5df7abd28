"""`starfed-positional`: STAR-Prompt whose trained tensors are averaged by position, as plain
FedAvg averages them, instead of class by class: what the codebook's per-class merge buys.

Plain FedAvg (Flower's ``aggregate_arrayrecords``, the reduction inside its ``FedAvg``)
averages every array over the round's sites, weighted by their examples. Every site holds every
class's rows; a site without images of a class returns them as it was sent them, and they still
count with the site's weight, so a class's training is diluted by the examples held elsewhere.
starfed averages a class only over the sites that carry it (docs/design.md#the-codebook).
Everything else — sync, statistics and their mixture merge, both replays, evaluation — is
starfed's: only the training phases' aggregation is overridden.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from starfed.ops.flower_internals import aggregate_arrayrecords
from starfed.server.strategy import MeanStrategy, PhaseState
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.protocol import Phase

WEIGHT = "num-examples"  # FedAvg's default weighting key


class PositionalAveraging(MeanStrategy):
    def aggregate_training(
        self, phase: Phase, updates: Iterable[ClientUpdate], state: PhaseState
    ) -> Codebook:
        """FedAvg over the classes in play: each update becomes the full array set a plain
        FedAvg client would return (the broadcast rows of the classes it did not train),
        weighted by the examples it trained on. Classes' counts are those of the per-class
        merge. Without any update the codebook stays as sent (the step then fails)."""
        codebook, fields = state.codebook, schema.trained_in(phase)
        in_play = [name for name in state.in_play if not codebook[name].frozen]
        records: list[RecordDict] = []
        counts: dict[str, int] = {}
        for update in updates:
            trained = {entry.name: entry for entry in update.entries}
            arrays = {
                f"{name}/{f}": Array(
                    (trained[name] if name in trained else codebook[name]).tensor(f).numpy()
                )
                for name in in_play
                for f in fields
            }
            for entry in update.entries:
                counts[entry.name] = counts.get(entry.name, 0) + entry.count
            examples = sum(entry.count for entry in update.entries)
            metrics = MetricRecord({WEIGHT: examples})
            records.append(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}))
        if not counts:
            return codebook
        merged = aggregate_arrayrecords(records, WEIGHT)
        values = {
            name: {f: torch.from_numpy(merged[f"{name}/{f}"].numpy()).float() for f in fields}
            for name in in_play
        }
        return codebook.set_values(values, counts)
