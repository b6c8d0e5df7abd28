"""`fedavg`: federated fine-tuning with FedAvg and no continual mechanism (the lower bound).

A linear head on the frozen ViT's features (the final-LayerNorm class token, what STAR-Prompt's
second level classifies without residuals) is trained task after task at the scenario's sites
and averaged with Flower's built-in ``FedAvg`` strategy (``flwr.serverapp.strategy``). The
model here is plain — one weight and one bias array, the same shape at every site — which is
exactly what FedAvg averages. starfed itself cannot use it: its sites hold different classes
and send only their rows, so the server merges class by class (docs/design.md#the-codebook).

Nothing protects what was learned: no prompts, no replay, no mixtures. A task's training sees
only its own classes, while the logits of every seen class compete (class-incremental), so the
earlier classes are pushed down: forgetting by design. It measures how much of a federation's
accuracy the continual mechanism earns.

Same data as ``starfed`` (the scenario's partition of each task over its sites, ``Scenario``),
same backbones, the budget of STAR-Prompt's second level per task: ``stage2-rounds`` rounds of
``stage2-epochs`` local epochs, batches of ``batch-size``. The federation runs on the local
runtime (a ``LocalGrid`` around this module's ClientApp; ``FedAvg.start`` is what a ServerApp's
main would call). After each step the head is scored on the split's test images of every seen
task, into the same accuracy matrix, FAA and forgetting (``starfed.shared.metrics``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from rich.console import Console
from torch import nn

from starfed.client.answer import default_cache_dir
from starfed.shared.config import parse
from starfed.shared.data.images import decode_images, to_unit
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.knob import Values, as_float, as_int, as_str
from starfed.shared.metrics import final_average_accuracy, final_forgetting, nan_to_none
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.features import EVAL_BATCH_SIZE, Views
from starfed.shared.model.second_level import PromptedViT
from starfed.shared.model.training import TrainConfig, phase_generator
from starfed.shared.protocol import CONFIG_RECORD, ROUND, STEP, record_int
from starfed.simulations.local_grid import LocalGrid, new_run_id, node_configs
from starfed.simulations.methods import cell_run_config

#: Adam's learning rate for the head. STAR-Prompt's second level uses 0.001 on prompts that
#: start from a trained head; a head from zero needs more steps than 5 epochs of 1-2 batches
#: give at that rate, and an untrained head would measure nothing.
HEAD_LR = 0.01


@dataclass
class Features:
    """Frozen ViT features of a set of images and their split labels."""

    x: torch.Tensor  # float32 [N, d_vit]
    y: torch.Tensor  # int64 [N]


@torch.no_grad()
def vit_features(backbones: Backbones, images: torch.Tensor) -> torch.Tensor:
    """Final-LayerNorm class-token features of un-augmented uint8 images, on the CPU."""
    vit, views = PromptedViT(backbones.vit, backbones.fast_towers), Views.of(backbones)
    out = [
        vit(views.pair(to_unit(images[i : i + EVAL_BATCH_SIZE].to(backbones.device)))[0])
        .float()
        .cpu()
        for i in range(0, len(images), EVAL_BATCH_SIZE)
    ]
    return torch.cat(out) if out else torch.zeros(0, backbones.dims.d_vit)


class SiteFeatures:
    """Every site's training features per task, and the test features, computed once."""

    def __init__(self, scenario: Scenario, backbones: Backbones, cache_dir: Path) -> None:
        split, size = scenario.split, backbones.config.image_size
        every = range(split.n_tasks)
        self.scenario = scenario
        train = decode_images(split.samples("train", every), size, cache_dir, progress=False)
        test = decode_images(split.samples("test", every), size, cache_dir, progress=False)
        self.train = Features(vit_features(backbones, train.images), train.labels)
        self.test = Features(vit_features(backbones, test.images), test.labels)
        self._row = {path: i for i, path in enumerate(train.paths)}  # real paths

    def site_task(self, site: int, step: int) -> Features:
        """The site's share of its task at global ``step`` (its readable images); nothing
        before it joins or after its stream ends."""
        task = self.scenario.task_at(site, step)
        samples = [] if task is None else self.scenario.train_samples(site, task)
        rows = [self._row[p] for p in (os.path.realpath(p) for p, _ in samples) if p in self._row]
        index = torch.tensor(rows, dtype=torch.int64)
        return Features(self.train.x[index], self.train.y[index])


def _masked(logits: torch.Tensor, n_seen: int) -> torch.Tensor:
    """Class-incremental logits: classes not seen yet cannot be predicted."""
    return logits[:, :n_seen]


def local_training(
    head: nn.Linear, data: Features, n_seen: int, train: TrainConfig, stream: torch.Generator
) -> None:
    """Plain fine-tuning: cross-entropy over the seen classes on this task's images only."""
    optimiser = torch.optim.Adam(head.parameters(), lr=HEAD_LR)
    for _ in range(train.stage2_epochs):
        for batch in torch.randperm(len(data.y), generator=stream).split(train.batch_size):
            loss = nn.functional.cross_entropy(_masked(head(data.x[batch]), n_seen), data.y[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()


def client_app(features: SiteFeatures, n_classes: int, train: TrainConfig) -> ClientApp:
    """A ClientApp whose node (``partition-id``) trains the head on its share of its task."""
    app = ClientApp()

    @app.train()
    def fit(message: Message, context: Context) -> Message:
        config = message.content[CONFIG_RECORD]
        site, step = int(context.node_config["partition-id"]), record_int(config[STEP], STEP)
        head = nn.Linear(features.train.x.shape[1], n_classes)
        head.load_state_dict(message.content.array_records["arrays"].to_torch_state_dict())
        data = features.site_task(site, step)
        if len(data.y):
            round_index = record_int(config[ROUND], ROUND)
            stream = phase_generator(train.seed, step, f"fedavg/{site}", round_index)
            local_training(head, data, record_int(config["seen"], "seen"), train, stream)
        reply = RecordDict(
            {
                "arrays": ArrayRecord(head.state_dict()),
                "metrics": MetricRecord({"num-examples": len(data.y)}),
            }
        )
        return Message(reply, reply_to=message)

    return app


class CountingGrid(LocalGrid):
    """The local runtime, counting each message's and reply's array bytes (``exchanges``)."""

    exchanges: list[dict]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        messages = list(messages)
        sizes = {m.metadata.dst_node_id: _array_bytes(m.content) for m in messages}
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            node = reply.metadata.src_node_id
            up = 0 if reply.has_error() else _array_bytes(reply.content)
            self.exchanges.append({"node_id": node, "bytes_down": sizes[node], "bytes_up": up})
        return replies


def _array_bytes(content: RecordDict) -> int:
    return sum(len(a.data) for record in content.array_records.values() for a in record.values())


@torch.no_grad()
def accuracy_per_task(head: nn.Linear, test: Features, scenario: Scenario, n_tasks: int) -> list:
    """% correct on each of the first ``n_tasks`` tasks' test images, predicting among their
    classes (NaN for a task without test images)."""
    split = scenario.split
    n_seen = n_tasks * split.classes_per_task
    predicted = _masked(head(test.x), n_seen).argmax(-1)
    row = []
    for task in range(n_tasks):
        mine = torch.isin(test.y, torch.tensor(split.task_labels(task)))
        correct, images = int((predicted[mine] == test.y[mine]).sum()), int(mine.sum())
        row.append(100 * correct / images if images else float("nan"))
    return row


def run(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    started = time.perf_counter()
    config = parse(cell_run_config(values, seed, out_dir))
    train = TrainConfig.from_config(config)
    torch.manual_seed(seed)
    random.seed(seed)  # FedAvg samples its nodes with ``random``
    scenario = Scenario(ScenarioConfig.from_config(config))
    split = scenario.split
    backbones = BackboneOptions.from_config(config).load(as_str(config, "device"))
    features = SiteFeatures(scenario, backbones, default_cache_dir() / "images")
    n_sites = scenario.n_sites
    head = nn.Linear(backbones.dims.d_vit, split.n_classes)
    grid = CountingGrid(
        client_app(features, split.n_classes, train),
        dict(config),
        node_configs(n_sites),
        new_run_id(),
    )
    grid.exchanges = []
    strategy = FedAvg(
        fraction_train=as_float(config, "fraction-train"),
        fraction_evaluate=0.0,
        min_train_nodes=min(as_int(config, "min-train-sites"), n_sites),
        min_available_nodes=n_sites,
    )
    matrix: list[list[float]] = []
    for step in range(scenario.n_steps):
        arrived = min(step, split.n_tasks - 1) + 1
        seen = arrived * split.classes_per_task
        for round_index in range(as_int(config, "stage2-rounds")):
            # One FedAvg round per call: a site trains on its task at ``step``.
            sent = ConfigRecord({STEP: step, ROUND: round_index, "seen": seen})
            arrays = ArrayRecord(head.state_dict())
            result = strategy.start(
                cast(Grid, grid),  # Flower types it so; a LocalGrid serves it duck-typed
                arrays,
                num_rounds=1,
                timeout=as_float(config, "timeout-s"),
                train_config=sent,
            )
            head.load_state_dict(result.arrays.to_torch_state_dict())
        matrix.append(accuracy_per_task(head, features.test, scenario, arrived))
        console.print(f"step {step + 1}/{scenario.n_steps}: accuracy {matrix[-1]}")
    metrics = {
        "method": "fedavg",
        "accuracy_matrix": matrix,
        "final_average_accuracy": final_average_accuracy(matrix),
        "final_forgetting": final_forgetting(matrix),
        "prompt_selection_accuracy_matrix": [],
        "exchanges": grid.exchanges,
        "wall_time_s": time.perf_counter() - started,
        "head_lr": HEAD_LR,
        "backbone_fingerprint": backbones.fingerprint,
        "config": dict(config),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(nan_to_none(metrics), indent=2))
    console.print(
        f"FAA {metrics['final_average_accuracy']:.2f}% · forgetting "
        f"{metrics['final_forgetting']:.2f}"
    )
