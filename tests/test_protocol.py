"""Protocol tests: the real ServerApp logic against the real ClientApp, in process.

Every run goes through ``LocalGrid`` (``starfed.simulations.local_grid``), which calls the real
ClientApp handlers for each node; faults tamper with, replace or drop one node's replies.
Sizes are the smallest that exercise the protocol: tiny backbones, the bundled mini dataset,
2 tasks x 2 classes, one epoch everywhere. All runs share one on-disk cache (decoded images,
CLIP features), so only the first run pays for decoding.

What the server merged at each phase is read back from the codebook it checkpointed after it
(``Recorded.merged``): the one after ``stage1/0`` is the stage-1 merge, the one after
``stage2/0`` the stage-2 merge (what ``query.stage2_stats`` broadcasts). The stage-1 statistics
travel in the reply to ``train.stage1``; they are recorded as ``query.stage1_stats`` updates.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from starfed.client import answer
from starfed.client import app as client_app
from starfed.client.memory import SiteMemory
from starfed.client.site import Site
from starfed.proto import codebook_pb2 as pb
from starfed.server.app import run_server
from starfed.server.federation import Federation
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.server.records import Position
from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.config import parse
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.data.site_folder import class_key
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.backbones import create_backbones
from starfed.shared.protocol import MESSAGES, TRAVELLING, ConfigValue, Phase
from starfed.simulations.local_grid import LocalGrid
from starfed.simulations.simulated_sites import SimulatedSites

sys.path.insert(0, str(Path(__file__).parent))

BASE_CONFIG = {
    "preset": "tiny",
    "num-tasks": 2,
    "classes-per-task": 2,
    "seed": 1993,
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "timeout-s": 5,
}
UPDATE_TYPES = ("train.stage1", "query.stage1_stats", "train.stage2", "query.stage2_stats")
ALL_TYPES = ("query.sync", *UPDATE_TYPES, "evaluate")
# the stage-1 statistics travel with stage 1, the evaluation with the next step's sync
MESSAGES_PER_STEP = len(ALL_TYPES) - 2
STAGE1_FIELDS = schema.trained_in(Phase.STAGE1)
STAGE2_FIELDS = schema.trained_in(Phase.STAGE2)
# The server re-aligns the prediction head over all seen classes at every step (head replay,
# docs/model.md); every other part of a frozen class is final.
FINAL_FIELDS = tuple(f for f in schema.TENSORS if not f.startswith("aligned_"))
PHASE_OF = {spec.message_type: spec.phase for spec in MESSAGES}
TYPE_OF = {spec.phase.key: spec.message_type for spec in MESSAGES}

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_run_ids = itertools.count(1000)


# --- helpers ----------------------------------------------------------------------------------


@dataclass
class Recorded:
    """Replies captured by recording faults, keyed by (step, message type, node), each with the
    id of the message it answers (an update that travelled with another message under its own
    phase's message type), and the codebooks checkpointed by (step, the phase done)."""

    grid: LocalGrid
    updates: dict[tuple[int, str, int], tuple[bytes, str]] = field(default_factory=dict)
    syncs: dict[tuple[int, int], ClientUpdate] = field(default_factory=dict)
    merged: dict[tuple[int, str], Codebook] = field(default_factory=dict)

    def update(self, step: int, message_type: str, node: int) -> ClientUpdate:
        data, message_id = self.updates[(step, message_type, node)]
        against = self.grid.codebooks_sent()[message_id]
        return wire.decode_update(data, against=against, phase=PHASE_OF[message_type])


def make_grid(cache_dir: Path, n_sites: int, **overrides) -> LocalGrid:
    run_config = {**BASE_CONFIG, "num-sites": n_sites, **overrides}
    nodes = {
        i + 1: {"partition-id": i, "num-partitions": n_sites, "cache-dir": str(cache_dir)}
        for i in range(n_sites)
    }
    return LocalGrid(client_app.app, run_config, nodes, run_id=next(_run_ids), record=True)


def sent_config(grid: LocalGrid) -> tuple[int, int]:
    """(step, node) of the message the grid is answering now (faults run right after it)."""
    message = grid.sent[-1]
    return int(message.content["config"]["step"]), message.metadata.dst_node_id


def recording(grid: LocalGrid, recorded: Recorded):
    """A fault that stores the reply and passes it on unchanged."""

    def fault(reply: Message) -> Message | None:
        step, node = sent_config(grid)
        sent = grid.sent[-1]
        message_type = sent.metadata.message_type
        if not reply.has_error() and "update" in reply.content:
            data = reply.content["update"]["data"]
            if message_type == "query.sync":
                own = BackboneOptions.from_config(parse(grid.run_config)).load()
                against = Codebook(own.fingerprint, own.dims)
                sync = wire.decode_update(data, against=against, phase=Phase.SYNC)
                recorded.syncs[(step, node)] = sync
            else:
                recorded.updates[(step, message_type, node)] = (data, sent.metadata.message_id)
            for key in sent.content["config"].get(TRAVELLING, []):
                data = reply.content[key]["data"]
                recorded.updates[(step, TYPE_OF[key], node)] = (data, sent.metadata.message_id)
        return reply

    return fault


def record_all(grid: LocalGrid, nodes: list[int] | None = None) -> Recorded:
    recorded = Recorded(grid)
    for node in nodes if nodes is not None else list(grid.node_configs):
        for message_type in ("query.sync", *UPDATE_TYPES):
            grid.faults[(node, message_type)] = recording(grid, recorded)
    return recorded


def broadcast(grid: LocalGrid, step: int, message_type: str) -> Codebook:
    """The codebook the server sent with ``message_type`` at ``step`` (same for every node)."""
    sent = grid.codebooks_sent()
    for message in grid.sent:
        config = message.content["config"]
        if message.metadata.message_type == message_type and int(config["step"]) == step:
            return sent[message.metadata.message_id]
    raise AssertionError(f"no {message_type} broadcast at step {step}")


def run(
    grid: LocalGrid,
    results: Path,
    name: str = "run",
    recorded: Recorded | None = None,
    strategy: Strategy | None = None,
) -> dict:
    """The server's run (with ``strategy``); with ``recorded``, every checkpointed codebook is
    kept there too."""
    config = {**grid.run_config, "results-dir": str(results), "run-name": name}
    grid.run_config = config
    sites = SimulatedSites.of(config, grid.run_id)  # the simulation writes the sites' folders
    with pytest.MonkeyPatch.context() as patch:
        if recorded is not None:
            checkpoint = Federation.checkpoint

            def keep(federation: Federation, codebook: Codebook, position: Position) -> Codebook:
                kept = checkpoint(federation, codebook, position)
                if position.done:  # not the end of a step
                    recorded.merged[(position.step, position.done[-1].to_json())] = kept
                return kept

            patch.setattr(Federation, "checkpoint", keep)
        return run_server(grid, config, grid.run_id, before_step=sites, strategy=strategy)


def exchanges(metrics: dict, node: int | None = None, phase: str | None = None) -> list[dict]:
    return [
        e
        for e in metrics["exchanges"]
        if (node is None or e["node_id"] == node) and (phase is None or e["phase"] == phase)
    ]


def entry(update: ClientUpdate, name: str):
    (found,) = [e for e in update.entries if e.name == name]
    return found


def row(codebook: Codebook, field_name: str, name: str):
    return codebook[name].values[field_name]


def row_count(codebook: Codebook, name: str) -> int:
    return codebook[name].count


def counts_of(codebook: Codebook) -> dict[str, int]:
    return {name: e.count for name, e in codebook.entries.items()}


def weighted_mean(rows: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    total = sum(counts)
    return sum(r.double() * (c / total) for r, c in zip(rows, counts, strict=True)).float()


def class_counts(scenario: Scenario, task: int) -> dict[str, list[int]]:
    """Training images per site of each class of ``task``: name -> [count per site]."""
    folders = scenario.split.class_folders
    labels = scenario.split.task_labels(task)
    counts = scenario.class_counts(task)
    return {folders[label]: counts[:, col].tolist() for col, label in enumerate(labels)}


def scenario_of(grid: LocalGrid) -> Scenario:
    return Scenario(ScenarioConfig.from_config(parse(grid.run_config)))


def assert_finite(codebook: Codebook) -> None:
    for e in codebook.entries.values():
        for name, value in e.values.items():
            if name in schema.MIXTURES:
                assert torch.isfinite(value.means).all() and torch.isfinite(value.variances).all()
            else:
                assert torch.isfinite(value).all(), name


def assert_completed(metrics: dict, run_dir: Path, n_classes: int = 4) -> Codebook:
    """The run went through every step and left a complete, fully frozen codebook."""
    assert len(metrics["classes"]) == n_classes
    assert len(metrics["accuracy_matrix"]) == metrics["steps"] == 2
    codebook = wire.read_file(run_dir / CODEBOOK_FILE, fingerprint=metrics["backbone_fingerprint"])
    assert codebook.names == list(metrics["classes"])
    assert codebook.frozen == set(metrics["classes"])
    assert all(set(schema.MIXTURES) <= set(e.values) for e in codebook.entries.values())
    assert_finite(codebook)
    return codebook


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("site-cache")


@dataclass
class BaselineRun:
    grid: LocalGrid
    recorded: Recorded
    metrics: dict
    run_dir: Path
    counts: dict[int, dict[str, list[int]]]  # task -> class -> per-site counts


def _baseline_run(cache_dir: Path, tmp_path_factory, **overrides) -> BaselineRun:
    grid = make_grid(cache_dir, 3, alpha=0.1, **overrides)
    recorded = record_all(grid)
    results = tmp_path_factory.mktemp("results")
    metrics = run(grid, results, "baseline", recorded)
    scenario = scenario_of(grid)
    counts = {task: class_counts(scenario, task) for task in range(2)}
    return BaselineRun(grid, recorded, metrics, results / "baseline", counts)


@pytest.fixture(scope="module")
def baseline(cache_dir, tmp_path_factory) -> BaselineRun:
    """3 sites, alpha 0.1: in task 0 one class is held by all three, the other by one."""
    return _baseline_run(cache_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def mean_baseline(cache_dir, tmp_path_factory) -> BaselineRun:
    """The baseline's federation with ``merge = mean``: the examples-weighted average."""
    return _baseline_run(cache_dir, tmp_path_factory, merge="mean")


def holders(counts: dict[str, list[int]], name: str) -> list[int]:
    """Node ids (partition + 1) holding training images of ``name``."""
    return [site + 1 for site, n in enumerate(counts[name]) if n > 0]


# --- merging ----------------------------------------------------------------------------------


def test_baseline_exchanges_all_ok(baseline):
    metrics = baseline.metrics
    n_nodes = len(baseline.grid.node_configs)
    assert metrics["steps"] == 2 and metrics["status"] == "completed"
    # two steps, then a sync that finds nothing new, ends the run and carries the last
    # step's evaluation; no evaluation has a message of its own
    for node in range(1, n_nodes + 1):
        sent = [m for m in baseline.grid.sent if m.metadata.dst_node_id == node]
        assert len(sent) == 2 * MESSAGES_PER_STEP + 1
        assert "evaluate" not in {m.metadata.message_type for m in sent}
    # each message logged, and each evaluation apart from the sync it travelled with
    assert len(metrics["exchanges"]) == (2 * MESSAGES_PER_STEP + 1 + 2) * n_nodes
    assert "stage1_stats" not in {e["phase"] for e in metrics["exchanges"]}
    assert {e["status"] for e in metrics["exchanges"]} == {"ok"}
    for e in metrics["exchanges"]:
        assert e["bytes_up"] > 0
        assert (e["bytes_down"] == 0) == (e["phase"] == "sync")
    # Each node reports its own classes at sync, with its own counts.
    for step in range(2):
        for node in baseline.grid.node_configs:
            sync = baseline.recorded.syncs[(step, node)]
            expected = {
                name: per_client[node - 1]
                for name, per_client in baseline.counts[step].items()
                if per_client[node - 1] > 0
            }
            assert {e.name: e.count for e in sync.entries} == expected
            assert sync.metadata["task"] == (f"task-{step:02d}" if expected else "")
            assert sync.metadata["site"] == f"site-{node - 1}"
    assert sorted(metrics["site_accuracy"]) == [f"site-{i}" for i in range(n_nodes)]
    assert 0.0 <= metrics["final_average_accuracy"] <= 100.0


def test_a_class_three_sites_hold_is_their_median_by_default(baseline):
    """The default merge (``median``): each number of a class that three sites hold is the
    median of their rows, whatever their counts; the count is their sum."""
    counts = baseline.counts[0]
    (name,) = [n for n, c in counts.items() if len(holders(counts, n)) == 3]
    nodes = holders(counts, name)
    for message_type, merged_at, fields in (
        ("train.stage1", "stage1/0", STAGE1_FIELDS),
        ("train.stage2", "stage2/0", STAGE2_FIELDS),
    ):
        merged = baseline.recorded.merged[(0, merged_at)]
        entries = [entry(baseline.recorded.update(0, message_type, node), name) for node in nodes]
        assert row_count(merged, name) == sum(e.count for e in entries)
        for field_name in fields:
            rows = torch.stack([e.values[field_name] for e in entries])
            assert torch.equal(row(merged, field_name, name), rows.median(dim=0).values)


def test_shared_class_row_is_count_weighted_average(mean_baseline):
    baseline = mean_baseline
    grid, recorded = baseline.grid, baseline.recorded
    shared = [n for n, c in baseline.counts[0].items() if len(holders(baseline.counts[0], n)) > 1]
    assert shared, "the scenario must have a class several sites hold"
    name = shared[0]
    nodes = holders(baseline.counts[0], name)
    for message_type, merged_at, fields in (
        ("train.stage1", "stage1/0", STAGE1_FIELDS),
        ("train.stage2", "stage2/0", STAGE2_FIELDS),
    ):
        merged = recorded.merged[(0, merged_at)]
        entries = [entry(recorded.update(0, message_type, node), name) for node in nodes]
        counts = [e.count for e in entries]
        assert counts == [baseline.counts[0][name][node - 1] for node in nodes]
        assert row_count(merged, name) == sum(counts)
        for field_name in fields:
            rows = [e.values[field_name] for e in entries]
            expected = weighted_mean(rows, counts)
            torch.testing.assert_close(
                row(merged, field_name, name), expected, rtol=1e-6, atol=1e-7
            )
            if field_name in ("prompt", "query_prompt"):
                # A real average: no single site's row, not the unweighted mean.
                for r in rows:
                    assert not torch.equal(row(merged, field_name, name), r)
                unweighted = torch.stack(rows).mean(dim=0)
                assert (unweighted - expected).abs().max() > 1e-5
    # Mixtures stay on the server (broadcasts leave them out); the checkpoint holds them. The
    # merged G keeps the total count and the union's count-weighted mean.
    sent = broadcast(grid, 0, "train.stage2")
    assert not any("clip_mixture" in e.values for e in sent.entries.values())
    merged = wire.read_file(baseline.run_dir / CODEBOOK_FILE)
    mixtures = [
        entry(recorded.update(0, "query.stage1_stats", node), name).values["clip_mixture"]
        for node in nodes
    ]
    g = merged[name].values["clip_mixture"]
    total = sum(m.count for m in mixtures)
    assert g.count == total
    expected_mean = sum((m.count / total) * (m.weights @ m.means) for m in mixtures)
    torch.testing.assert_close(g.weights @ g.means, expected_mean, rtol=1e-9, atol=1e-9)


def test_single_holder_class_row_is_that_sites_row(baseline):
    grid, recorded = baseline.grid, baseline.recorded
    single = [n for n, c in baseline.counts[0].items() if len(holders(baseline.counts[0], n)) == 1]
    assert single, "the scenario must have a class only one site holds"
    name = single[0]
    (node,) = holders(baseline.counts[0], name)
    for message_type, merged_at, fields in (
        ("train.stage1", "stage1/0", STAGE1_FIELDS),
        ("train.stage2", "stage2/0", STAGE2_FIELDS),
    ):
        merged = recorded.merged[(0, merged_at)]
        own = entry(recorded.update(0, message_type, node), name)
        assert row_count(merged, name) == own.count == baseline.counts[0][name][node - 1]
        for field_name in fields:
            assert torch.equal(row(merged, field_name, name), own.values[field_name])
        # Other sites sent no row for it.
        for other in grid.node_configs:
            if other != node:
                update = recorded.update(0, message_type, other)
                assert name not in [e.name for e in update.entries]
    own_g = entry(recorded.update(0, "query.stage1_stats", node), name).values["clip_mixture"]
    merged = wire.read_file(baseline.run_dir / CODEBOOK_FILE)
    g = merged[name].values["clip_mixture"]
    assert g.count == own_g.count
    torch.testing.assert_close(g.means, own_g.means)
    torch.testing.assert_close(g.weights, own_g.weights)
    # Stage-2 rows are final: the frozen class ends the run with exactly the merged values.
    final = wire.read_file(baseline.run_dir / CODEBOOK_FILE)
    own = entry(recorded.update(0, "train.stage2", node), name)
    for field_name in STAGE2_FIELDS:
        assert torch.equal(row(final, field_name, name), own.values[field_name])


def test_checkpoint_files(baseline):
    metrics, run_dir = baseline.metrics, baseline.run_dir
    codebook = assert_completed(metrics, run_dir)
    assert codebook.version == metrics["codebook_version"]
    assert codebook.fingerprint == metrics["backbone_fingerprint"]
    expected_counts = {
        name: sum(per_client)
        for task in range(2)
        for name, per_client in baseline.counts[task].items()
    }
    assert counts_of(codebook) == expected_counts
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["classes"] == metrics["classes"]
    assert len(saved["exchanges"]) == len(metrics["exchanges"])


class StatisticsOnTheirOwn(MeanStrategy):
    """starfed's strategy with a config entry for the stage-1 statistics, which therefore
    cannot travel with stage 1: they are sent in their own message, as before."""

    def configure(self, phase: Phase, state: PhaseState) -> dict[str, ConfigValue]:
        return {"own-message": True} if phase is Phase.STAGE1_STATS else {}


def test_the_message_plan_does_not_move_the_numbers(baseline, cache_dir, tmp_path):
    """The stage-1 statistics travelling with stage 1 (the baseline run) or in their own
    message: the same codebook, tensor by tensor and mixture by mixture — the same values,
    merged in the same order — and the same scores."""
    grid = make_grid(cache_dir, 3, alpha=0.1)
    metrics = run(grid, tmp_path, "own-message", strategy=StatisticsOnTheirOwn())
    sent = [m.metadata.message_type for m in grid.sent]
    assert sent.count("query.stage1_stats") == 2 * len(grid.node_configs)
    assert "query.stage1_stats" not in {m.metadata.message_type for m in baseline.grid.sent}
    assert metrics["accuracy_matrix"] == baseline.metrics["accuracy_matrix"]
    own = wire.read_file(tmp_path / "own-message" / CODEBOOK_FILE)
    travelled = wire.read_file(baseline.run_dir / CODEBOOK_FILE)
    assert own.names == travelled.names and own.version == travelled.version
    for name in own.names:
        a, b = own[name], travelled[name]
        assert (a.count, a.frozen, set(a.values)) == (b.count, b.frozen, set(b.values))
        for field_name, value in a.values.items():
            if field_name in schema.MIXTURES:
                for part in ("weights", "means", "variances"):
                    assert torch.equal(getattr(value, part), getattr(b.values[field_name], part))
            else:
                assert torch.equal(value, b.values[field_name]), (name, field_name)


# --- failing and misbehaving sites ------------------------------------------------------------


@pytest.fixture
def pair(cache_dir) -> LocalGrid:
    """2 sites, alpha 0.5: both hold every class of both tasks, so either alone completes
    the run and the other's contribution is visible in every merge."""
    grid = make_grid(cache_dir, 2, alpha=0.5)
    scenario = scenario_of(grid)
    for task in range(2):
        assert all(c[0] > 0 and c[1] > 0 for c in class_counts(scenario, task).values())
    return grid


def node1_counts(grid: LocalGrid) -> dict[str, int]:
    scenario = scenario_of(grid)
    return {
        name: per_client[0]
        for task in range(2)
        for name, per_client in class_counts(scenario, task).items()
    }


def total_counts(grid: LocalGrid) -> dict[str, int]:
    scenario = scenario_of(grid)
    return {
        name: sum(per_client)
        for task in range(2)
        for name, per_client in class_counts(scenario, task).items()
    }


def test_client_raising_in_stage2(pair, tmp_path, monkeypatch):
    original = Site.run_phase

    def failing(self, phase, codebook, step, round_index=0):
        if self.name == "site-1" and phase == Phase.STAGE2:
            raise RuntimeError("boom")
        return original(self, phase, codebook, step, round_index)

    monkeypatch.setattr(Site, "run_phase", failing)
    recorded = record_all(pair, [1])
    metrics = run(pair, tmp_path)

    for e in exchanges(metrics, node=2):
        if e["phase"] == "stage2":
            assert e["status"].startswith("error")
            assert "boom" in e["status"]
            assert e["bytes_up"] == 0
        else:
            assert e["status"] == "ok"
    assert {e["status"] for e in exchanges(metrics, node=1)} == {"ok"}
    assert len(exchanges(metrics, node=2, phase="stage2")) == 2
    assert metrics["status"] == "degraded"
    # Stage 2 merged node 1 alone; the other phases still merged both sites.
    for step in range(2):
        merged = broadcast(pair, step, "query.stage2_stats")
        update = recorded.update(step, "train.stage2", 1)
        assert update.entries
        for e in update.entries:
            assert row_count(merged, e.name) == e.count
            for field_name in STAGE2_FIELDS:
                assert torch.equal(row(merged, field_name, e.name), e.values[field_name])
    # The stage-2 statistics of both sites still count: the class sums both.
    codebook = assert_completed(metrics, tmp_path / "run")
    assert counts_of(codebook) == total_counts(pair)


def test_silent_client(pair, tmp_path):
    for message_type in ALL_TYPES:
        pair.faults[(2, message_type)] = lambda reply: None
    metrics = run(pair, tmp_path)

    silent = exchanges(metrics, node=2)
    # a node that misses the sync is left out of the rest of the step (one timeout per step)
    assert [e["phase"] for e in silent] == ["sync", "sync", "sync"]
    assert all(e["status"] == "no reply" and e["bytes_up"] == 0 for e in silent)
    assert {e["status"] for e in exchanges(metrics, node=1)} == {"ok"}
    assert set(metrics["site_accuracy"]) == {"site-0"}
    assert metrics["status"] == "degraded"
    codebook = assert_completed(metrics, tmp_path / "run")
    # Every count is node 1's alone: nothing of node 2 reached the codebook.
    assert counts_of(codebook) == node1_counts(pair)


def garbage_update(reply: Message) -> Message:
    reply.content["update"]["data"] = b"garbage: not a ClientUpdate \xff\xfe"
    return reply


def nan_update(reply: Message) -> Message:
    """Put a NaN into the first tensor of the real update, bypassing the encoder's checks."""
    message = pb.ClientUpdate()
    message.ParseFromString(reply.content["update"]["data"])
    assert message.entries, "the node must have rows to poison"
    tensor = message.entries[0].query_prompt
    values = np.frombuffer(tensor.data, dtype="<f4").copy()
    values[3] = np.nan
    tensor.data = values.tobytes()
    reply.content["update"]["data"] = message.SerializeToString()
    return reply


def test_malformed_and_nan_updates_are_rejected(pair, tmp_path):
    recorded = record_all(pair, [1])
    pair.faults[(2, "train.stage1")] = garbage_update
    pair.faults[(2, "train.stage2")] = nan_update
    metrics = run(pair, tmp_path, recorded=recorded)

    stage1 = exchanges(metrics, node=2, phase="stage1")
    stage2 = exchanges(metrics, node=2, phase="stage2")
    assert len(stage1) == len(stage2) == 2
    for e in stage1:
        assert e["status"].startswith("rejected: ")
        assert "not a valid ClientUpdate" in e["status"]
    for e in stage2:
        assert e["status"].startswith("rejected: ")
        assert "NaN" in e["status"]
    others = [
        e
        for e in metrics["exchanges"]
        if e["node_id"] == 1 or e["phase"] not in ("stage1", "stage2")
    ]
    assert {e["status"] for e in others} == {"ok"}

    # The rejected updates left no trace: each merge equals node 1's rows exactly.
    for step in range(2):
        for message_type, merged_at, fields in (
            ("train.stage1", "stage1/0", STAGE1_FIELDS),
            ("train.stage2", "stage2/0", STAGE2_FIELDS),
        ):
            merged = recorded.merged[(step, merged_at)]
            assert_finite(merged)
            update = recorded.update(step, message_type, 1)
            assert update.entries
            for e in update.entries:
                assert row_count(merged, e.name) == e.count
                for field_name in fields:
                    assert torch.equal(row(merged, field_name, e.name), e.values[field_name])
    assert_completed(metrics, tmp_path / "run")


def test_malformed_sync_replies_are_rejected(pair, tmp_path):
    """A sync without the expected record, or naming classes the codebook cannot hold, is
    rejected; the node sits out that step and none of its names is registered."""

    def bad_sync(reply: Message) -> Message:
        step, _ = sent_config(pair)
        if step == 0:  # no "update" record at all
            return Message(RecordDict({"other": ConfigRecord({"x": 1})}), reply_to=pair.sent[-1])
        message = pb.ClientUpdate.FromString(reply.content["update"]["data"])
        for bad_name, target in zip(["", "x" * 300, "bell\x07"], message.entries, strict=False):
            target.name = bad_name
        reply.content["update"]["data"] = message.SerializeToString()
        return reply

    pair.faults[(2, "query.sync")] = bad_sync
    metrics = run(pair, tmp_path)

    node2 = exchanges(metrics, node=2)
    assert [e["phase"] for e in node2] == ["sync", "sync", "sync"]
    assert [e["status"] for e in node2] == [
        "rejected: malformed reply ('update')",
        "rejected: a class name is empty",
        "ok",  # the closing sync, when node 2 has nothing left to bring
    ]
    assert {e["status"] for e in exchanges(metrics, node=1)} == {"ok"}
    codebook = assert_completed(metrics, tmp_path / "run")
    assert counts_of(codebook) == node1_counts(pair)


def test_malformed_evaluate_reply_is_rejected(pair, tmp_path):
    """A sync reply whose travelling evaluation is malformed (step 1's), or missing as from a
    site of an earlier release (step 2's): each evaluation is rejected, the sync still counts."""

    def bad_metrics(reply: Message) -> Message:
        step, _ = sent_config(pair)
        if TRAVELLING in pair.sent[-1].content["config"]:
            if step == 1:
                reply.content["evaluate"] = ConfigRecord({"x": 1})
            else:
                del reply.content["evaluate"]
        return reply

    pair.faults[(2, "query.sync")] = bad_metrics
    metrics = run(pair, tmp_path)

    statuses = [e["status"] for e in exchanges(metrics, node=2, phase="evaluate")]
    assert len(statuses) == 2 and statuses[0] == "rejected: malformed reply ('data')"
    assert statuses[1] == (
        "rejected: its sync reply carries no evaluation (a site of an earlier release?)"
    )
    assert set(metrics["site_accuracy"]) == {"site-0"}
    assert metrics["status"] == "degraded"
    # node 2's training replies still count
    trained = [e for e in exchanges(metrics, node=2) if e["phase"] != "evaluate"]
    assert {e["status"] for e in trained} == {"ok"}
    codebook = assert_completed(metrics, tmp_path / "run")
    assert counts_of(codebook) == total_counts(pair)


def test_client_with_other_backbones(pair, tmp_path, cache_dir):
    foreign = create_backbones("tiny", seed=1)
    values = parse(pair.run_config)
    own = BackboneOptions.from_config(values).load()
    assert foreign.fingerprint != own.fingerprint
    pair.run_config = {**pair.run_config, "results-dir": str(tmp_path), "run-name": "run"}
    context = pair._context(2)  # node 2's site, then with other backbones
    site = answer.site_for(
        context.run_id, context.node_id, dict(context.run_config), dict(context.node_config)
    )
    site.backbones = foreign
    site.memory = SiteMemory(site.memory.root, foreign.fingerprint, foreign.dims)
    metrics = run(pair, tmp_path)

    # rejected at sync, the node is not asked again in that step
    foreign_exchanges = exchanges(metrics, node=2)
    assert [e["phase"] for e in foreign_exchanges] == ["sync", "sync", "sync"]
    for e in foreign_exchanges:
        assert e["status"].startswith("rejected: backbone fingerprint")
    assert {e["status"] for e in exchanges(metrics, node=1)} == {"ok"}
    codebook = assert_completed(metrics, tmp_path / "run")
    assert codebook.fingerprint == own.fingerprint
    assert counts_of(codebook) == node1_counts(pair)


# --- sites in different tasks -----------------------------------------------------------------


def test_clients_in_different_tasks(cache_dir, tmp_path):
    """Site 2 joins one step late: its first task is finished by then, so it brings nothing new
    (its classes stay frozen), trains nothing, and the run ends when no site brings a class."""
    grid = make_grid(cache_dir, 2, alpha=0.5, **{"arrival-offset": 1})
    recorded = record_all(grid)
    scenario = scenario_of(grid)
    task_classes = [sorted(class_counts(scenario, task), key=class_key) for task in range(2)]
    metrics = run(grid, tmp_path)
    run_dir = tmp_path / "run"

    # Which task each site was on: site 2 saw nothing at step 0 and only finished tasks later.
    tasks = {(s, n): recorded.syncs[(s, n)].metadata["task"] for s in range(3) for n in (1, 2)}
    assert tasks == {
        (0, 1): "task-00",
        (0, 2): "",
        (1, 1): "task-01",
        (1, 2): "",
        (2, 1): "",
        (2, 2): "",
    }
    assert metrics["steps"] == 2 and metrics["status"] == "completed"
    assert list(metrics["classes"]) == task_classes[0] + task_classes[1]
    assert {name: c["step"] for name, c in metrics["classes"].items()} == {
        **dict.fromkeys(task_classes[0], 0),
        **dict.fromkeys(task_classes[1], 1),
    }
    # Site 2 sent no rows: at step 1 its task 0 is finished, and task 1 arrives at step 2.
    for message_type in UPDATE_TYPES:
        assert [e.name for e in recorded.update(0, message_type, 1).entries] == task_classes[0]
        assert recorded.update(0, message_type, 2).entries == ()
        assert [e.name for e in recorded.update(1, message_type, 1).entries] == task_classes[1]
        assert recorded.update(1, message_type, 2).entries == ()
    # Counts of task 0 are site 1's alone (site 2 reached task 0 after it was frozen).
    codebook = wire.read_file(run_dir / CODEBOOK_FILE)
    for name in task_classes[0]:
        assert row_count(codebook, name) == class_counts(scenario, 0)[name][0]
    # Site 2 still evaluates every class it holds: its accuracy is reported.
    assert set(metrics["site_accuracy"]) == {"site-0", "site-1"}
    assert len(metrics["accuracy_matrix"]) == 2
    assert all(math.isfinite(a) for row_ in metrics["accuracy_matrix"] for a in row_)
    statuses = {e["status"] for e in metrics["exchanges"]}
    assert statuses == {"ok"}


@pytest.mark.parametrize("offset", [1, 2])
def test_asynchronous_arrival_completes_with_metrics(cache_dir, tmp_path, offset):
    """3 sites joining ``offset`` steps apart (what `starfed simulate --arrival-offset` runs):
    the run completes, writes metrics.json, and forgetting is defined although some sites
    saw tasks late."""
    grid = make_grid(cache_dir, 3, alpha=0.5, **{"arrival-offset": offset})
    metrics = run(grid, tmp_path)
    assert metrics["status"] == "completed" and metrics["steps"] == 2
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert math.isfinite(saved["final_average_accuracy"])
    assert math.isfinite(saved["final_forgetting"])
    assert set(saved["site_accuracy"]) == {"site-0", "site-1", "site-2"}
