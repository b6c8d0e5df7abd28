"""The federated baselines of `starfed experiment` (docs/results.md#methods): what each one
computes, on the smallest scenario (tiny backbones, 2 sites, 2 tasks x 2 classes).

- `fedavg` (FedAvg fine-tuning of a linear head): the lower bound forgets, and its exchanges
  are the head's bytes;
- `starfed-positional`: a class's tensors averaged over every site's examples, the broadcast
  rows of sites that did not train it included (plain FedAvg), next to the per-class merge;
- `starfed-unmerged`: every site's Gaussians kept, weighted by its examples, where the merge
  reduces them to ``mixture-components``;
- `starfed-no-replay`: starfed whose server never replays (statistics merged all the same);
- `starfed-keys`: starfed trained as usual, every evaluation with the first-level keys.

Each is a strategy passed to the coordinator (``starfed.server.strategy``), one module each.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from codebooks import merge_updates
from rich.console import Console

from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.config import parse
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import CLASSIFY_WITH_KEYS, Phase
from starfed.simulations.methods import (
    METHODS,
    MethodSpec,
    fedavg,
    no_replay,
    positional,
    unmerged,
)
from starfed.simulations.methods import keys as keys_method
from starfed.simulations.methods import starfed as federated

TINY = {"num-tasks": 2, "classes-per-task": 2, "num-sites": 2}
ONE_EPOCH = {
    "stage1-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "replay2-epochs-per-task": 0,
    "stage2-epochs": 1,
}
SEED = 1993


def _metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def _in_range(matrix: list[list[float]]) -> bool:
    return all(0 <= a <= 100 for row in matrix for a in row if a is not None)


def test_the_baselines_are_registered() -> None:
    for name in (
        "fedavg",
        "starfed-positional",
        "starfed-unmerged",
        "starfed-no-replay",
        "starfed-keys",
    ):
        assert callable(METHODS[name].load())
    strategies = {name: spec.strategy for name, spec in METHODS.items() if spec.strategy}
    assert strategies == {
        "starfed-keys": "ClassifyWithKeys",
        "starfed-no-replay": "NoReplay",
        "starfed-positional": "PositionalAveraging",
        "starfed-unmerged": "Unmerged",
    }
    for name, spec in METHODS.items():
        if spec.strategy:
            loaded = METHODS[name].load()
            assert isinstance(loaded.keywords["strategy"], Strategy), name
            # starfed itself on the local runtime, with a new instance of the module's class
            module = importlib.import_module(f"starfed.simulations.methods.{spec.module}")
            assert loaded.func is federated.run, name
            assert type(loaded.keywords["strategy"]) is getattr(module, spec.strategy), name
    assert METHODS["fedavg"].load() is fedavg.run


def registry_faults(methods: Mapping[str, MethodSpec], package: str) -> list[str]:
    """Where the registry and the modules of ``package`` disagree: a module of its folder the
    registry does not list, a listed module that is not there, a strategy class that is not a
    ``Strategy``, a ``run`` that is not there."""
    folder = Path(str(importlib.import_module(package).__file__)).parent
    listed = {spec.module for spec in methods.values()}
    faults = [
        f"{path.stem}: not listed"
        for path in sorted(folder.glob("[!_]*.py"))
        if path.stem not in listed
    ]
    for name, spec in methods.items():
        if not (folder / f"{spec.module}.py").is_file():
            faults.append(f"{name}: no module {spec.module}")
            continue
        module = importlib.import_module(f"{package}.{spec.module}")
        if spec.strategy is None and not callable(getattr(module, "run", None)):
            faults.append(f"{name}: {spec.module} has no run")
        found = getattr(module, spec.strategy or "", None)
        if spec.strategy and not (isinstance(found, type) and issubclass(found, Strategy)):
            faults.append(f"{name}: {spec.module}.{spec.strategy} is no Strategy")
    return faults


def test_the_registry_lists_every_method_module_and_what_it_defines() -> None:
    assert registry_faults(METHODS, "starfed.simulations.methods") == []


def test_the_registry_check_finds_what_a_module_lacks(tmp_path: Path, monkeypatch) -> None:
    """A module not listed, a listed one absent, a strategy or a ``run`` it does not define."""
    package = tmp_path / "other_methods"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "median.py").write_text(
        "from starfed.server.strategy import Strategy\n\n\nclass Median(Strategy):\n    pass\n"
    )
    (package / "fedprox.py").write_text("def train():\n    pass\n")
    (package / "stray.py").write_text("def run():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    methods = {
        "starfed-median": MethodSpec("median", "Median"),
        "starfed-mean": MethodSpec("median", "Mean"),
        "fedprox": MethodSpec("fedprox", None),
        "gone": MethodSpec("gone", None),
    }
    assert registry_faults(methods, "other_methods") == [
        "stray: not listed",
        "starfed-mean: median.Mean is no Strategy",
        "fedprox: fedprox has no run",
        "gone: no module gone",
    ]


def test_fedavg_fine_tuning_forgets(tmp_path: Path) -> None:
    """Task 2's training pushes task 1's classes down: the lower bound forgets."""
    out = tmp_path / "fedavg"
    fedavg.run(parse(TINY), SEED, out, Console(quiet=True))
    m = _metrics(out)
    matrix = m["accuracy_matrix"]
    assert [len(row) for row in matrix] == [1, 2] and _in_range(matrix)
    assert m["final_forgetting"] == pytest.approx(matrix[0][0] - matrix[1][0])
    assert m["final_forgetting"] > 0
    assert m["final_average_accuracy"] == pytest.approx((matrix[1][0] + matrix[1][1]) / 2)
    assert m["prompt_selection_accuracy_matrix"] == []
    # one message per site per round, each way the head: d_vit x classes weights + biases
    d_vit = BackboneOptions.from_config(parse(TINY)).load("cpu").dims.d_vit
    head_bytes = 4 * (d_vit + 1) * 4  # float32, 4 classes
    rounds = parse(TINY)["stage2-rounds"]
    assert len(m["exchanges"]) == 2 * 2 * rounds
    ((down, up),) = {(e["bytes_down"], e["bytes_up"]) for e in m["exchanges"]}
    assert down == up and head_bytes < down <= head_bytes + 2 * 256  # + a .npy header per array


def _codebook(dims: ModelDims) -> Codebook:
    zeros = torch.zeros(dims.d_txt)
    entries = {name: ClassEntry(name, 0, {"prompt": zeros}) for name in ("a", "b")}
    return Codebook("f" * 64, dims, entries, version=1)


def _state(codebook: Codebook) -> PhaseState:
    """What the coordinator shows a strategy (no backbones: these hooks merge only)."""
    return PhaseState(0, 0, codebook, ("a", "b"), {"a": 0, "b": 0}, None, TrainConfig())


def test_positional_fedavg_dilutes_what_the_per_class_merge_keeps() -> None:
    """Site 1 trains class a on 30 images, site 2 class b on 10: per class, each keeps its
    trainer's rows; by position, each is diluted by the other site's unchanged broadcast."""
    dims = ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)
    codebook = _codebook(dims)
    updates = [
        ClientUpdate(
            "f" * 64, dims, Phase.STAGE1, 1, [ClassEntry("a", 30, {"prompt": torch.ones(3)})]
        ),
        ClientUpdate(
            "f" * 64,
            dims,
            Phase.STAGE1,
            1,
            [ClassEntry("b", 10, {"prompt": torch.full((3,), 2.0)})],
        ),
    ]
    strategy = positional.PositionalAveraging()
    by_position = strategy.aggregate_training(Phase.STAGE1, iter(updates), _state(codebook))
    assert MeanStrategy().aggregate_training(
        Phase.STAGE1, iter(updates), _state(codebook)
    ).names == [
        "a",
        "b",
    ]
    per_class = merge_updates(codebook, updates)
    assert torch.allclose(per_class["a"].values["prompt"], torch.ones(3))
    assert torch.allclose(per_class["b"].values["prompt"], torch.full((3,), 2.0))
    assert torch.allclose(by_position["a"].values["prompt"], torch.full((3,), 30 / 40))
    assert torch.allclose(by_position["b"].values["prompt"], torch.full((3,), 2 * 10 / 40))
    assert (by_position["a"].count, by_position["b"].count) == (30, 10)
    assert by_position.version == codebook.version + 1


def test_positional_fedavg_without_any_update_keeps_the_codebook_sent() -> None:
    """Nothing to average: the codebook as sent (the coordinator then fails the step, as no
    class in play got an update)."""
    dims = ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)
    codebook = _codebook(dims)
    strategy = positional.PositionalAveraging()
    assert strategy.aggregate_training(Phase.STAGE1, iter([]), _state(codebook)) is codebook


def test_only_the_evaluate_message_asks_the_sites_for_the_keys() -> None:
    """`starfed-keys` changes one thing of what the server sends: the evaluate message's config
    asks for the keys; starfed's own strategy asks nothing of any phase."""
    state = _state(_codebook(ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)))
    for phase in Phase:
        asked = keys_method.ClassifyWithKeys().configure(phase, state)
        assert asked == ({CLASSIFY_WITH_KEYS: True} if phase is Phase.EVALUATE else {}), phase
        assert MeanStrategy().configure(phase, state) == {}, phase


def _mixture(centre: float, count: int, generator: torch.Generator) -> GaussianMixture:
    """Three components around ``centre`` in 2 dimensions."""
    means = centre + torch.randn(3, 2, generator=generator, dtype=torch.float64)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    return GaussianMixture(weights, means, torch.ones(3, 2, dtype=torch.float64), count)


def test_unmerged_statistics_keep_every_sites_gaussians() -> None:
    """Two sites' 3-component mixtures of class a: the merge reduces them to 2 components;
    the pool keeps all 6, each site's weighted by its share of the examples (30 of 40)."""
    dims = ModelDims(d_txt=3, d_clip=2, d_vit=5, n_layers=2)
    codebook = _codebook(dims)
    generator = torch.Generator().manual_seed(0)
    first, second = _mixture(0.0, 30, generator), _mixture(10.0, 10, generator)
    updates = [
        ClientUpdate(
            "f" * 64, dims, Phase.STAGE1_STATS, 1, [ClassEntry("a", m.count, {"clip_mixture": m})]
        )
        for m in (first, second)
    ]
    strategy = unmerged.Unmerged()
    pooled_codebook = strategy.aggregate_statistics(
        Phase.STAGE1_STATS, iter(updates), _state(codebook)
    )
    pooled = pooled_codebook["a"].values["clip_mixture"]
    merged = merge_updates(codebook, updates, n_components=2)["a"].values["clip_mixture"]
    assert merged.n_components == 2 and pooled.n_components == 6
    assert pooled.count == merged.count == 40
    assert torch.allclose(pooled.weights, torch.cat([0.75 * first.weights, 0.25 * second.weights]))
    assert torch.equal(pooled.means, torch.cat([first.means, second.means]))
    # the merge keeps the union's mean: the pool's, exactly what the sites sent
    assert torch.allclose(merged.weights @ merged.means, pooled.weights @ pooled.means)


def _head_entry(centre: float, generator: torch.Generator, frozen: bool = False) -> ClassEntry:
    """A class with a real-data head, a different aligned one and a one-component H_c."""
    dims = ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)
    values: dict[str, object] = {
        f.name: torch.zeros(f.shape(dims)) for f in schema.FIELDS if f.kind is schema.Kind.TENSOR
    }
    weight = torch.randn(5, generator=generator)
    values.update(
        head_weight=weight,
        head_bias=torch.tensor(0.1),
        aligned_head_weight=weight + 1,
        aligned_head_bias=torch.tensor(0.0),
    )
    means = centre + torch.randn(1, 5, generator=generator, dtype=torch.float64)
    ones = torch.ones(1, 5, dtype=torch.float64)
    values["vit_mixture"] = GaussianMixture(torch.ones(1, dtype=torch.float64), means, ones, 10)
    return ClassEntry(f"c{centre:g}", 10, values, frozen=frozen)


def test_without_replay_the_predicting_head_is_the_merged_real_data_head() -> None:
    """After a second step's stage-2 statistics, starfed aligns every class's head by replay
    on the H_c; `starfed-no-replay` keeps the merged real-data head of every class, and
    finishes the step's classes all the same."""
    generator = torch.Generator().manual_seed(0)
    past, new = _head_entry(0.0, generator, frozen=True), _head_entry(3.0, generator)
    dims = ModelDims(d_txt=3, d_clip=4, d_vit=5, n_layers=2)
    codebook = Codebook("f" * 64, dims, {past.name: past, new.name: new}, version=1)
    train = replace(TrainConfig(), replay2_epochs=1, replay2_epochs_per_task=0)
    cpu = SimpleNamespace(device=torch.device("cpu"))  # the head's replay needs no backbone
    state = PhaseState(1, 0, codebook, (new.name,), {past.name: 0, new.name: 1}, cpu, train)
    replayed = MeanStrategy().replay(Phase.STAGE2_STATS, codebook, state)
    kept = no_replay.NoReplay().replay(Phase.STAGE2_STATS, codebook, state)
    assert kept.frozen == replayed.frozen == {past.name, new.name}
    for name in codebook.names:
        head, bias = codebook[name].values["head_weight"], codebook[name].values["head_bias"]
        assert torch.equal(kept[name].values["aligned_head_weight"], head), name
        assert torch.equal(kept[name].values["aligned_head_bias"], bias), name
        assert not torch.equal(replayed[name].values["aligned_head_weight"], head), name


def test_starfed_without_generative_replay(tmp_path: Path) -> None:
    """The server merges the statistics but never replays: the predicting head is the merged
    real-data head of every class."""
    out = tmp_path / "no-replay"
    run = METHODS["starfed-no-replay"].load()
    run(parse({**TINY, **ONE_EPOCH}), SEED, out, Console(quiet=True))
    m = _metrics(out)
    assert m["config"]["strategy"] == f"{no_replay.__name__}.NoReplay"
    assert m["config"]["train"]["seed"] == SEED
    codebook = wire.read_file(out / "codebook.bin")
    assert len(codebook) == 4 and codebook.frozen == set(codebook.names)
    for name in codebook.names:
        values = codebook[name].values
        assert values["clip_mixture"] is not None and values["vit_mixture"] is not None
        assert torch.equal(values["aligned_head_weight"], values["head_weight"]), name
        assert torch.equal(values["aligned_head_bias"], values["head_bias"]), name
    assert [len(row) for row in m["accuracy_matrix"]] == [1, 2]
    assert _in_range(m["accuracy_matrix"]) and not math.isnan(m["final_average_accuracy"])
    assert m["exchanges"]


def test_starfed_classifying_with_keys_trains_the_same_codebook(tmp_path: Path, monkeypatch):
    """Only evaluation changes: the codebook equals plain starfed's, and every prediction the
    cell makes (the sites' evaluations) uses the keys."""
    values = parse({**TINY, **ONE_EPOCH})
    federated.run(values, SEED, tmp_path / "starfed", Console(quiet=True))
    calls: list[bool] = []
    predict = StarPrompt.predict

    def recording(self, *args, use_keys: bool = False, **kwargs):
        calls.append(use_keys)
        return predict(self, *args, use_keys=use_keys, **kwargs)

    monkeypatch.setattr(StarPrompt, "predict", recording)
    METHODS["starfed-keys"].load()(values, SEED, tmp_path / "keys", Console(quiet=True))
    assert calls and all(calls)
    m = _metrics(tmp_path / "keys")
    assert m["config"]["strategy"] == f"{keys_method.__name__}.ClassifyWithKeys"
    assert _in_range(m["accuracy_matrix"]) and not math.isnan(m["final_average_accuracy"])
    plain, keys = (wire.read_file(tmp_path / name / "codebook.bin") for name in ("starfed", "keys"))
    assert plain.names == keys.names
    for name in plain.names:
        for field, value in plain[name].values.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(keys[name].values[field], value), (name, field)
