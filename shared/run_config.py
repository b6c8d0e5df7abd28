"""Typed views of a Flower run config (``[tool.flwr.app.config]`` plus ``--run-config``).

Client and server read the same keys, so parsing lives here once. Keys use dashes, as in
Flower's TOML; an empty string means "not set" for optional paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from starfed.shared.model.backbones import Backbones, create_backbones
from starfed.shared.model.training import TrainConfig

RunConfig = Mapping[str, Any]


def get(run_config: RunConfig, key: str, kind: type, default: Any) -> Any:
    """``run_config[key]`` converted to ``kind``; a clear ValueError names a bad key.

    Numbers may come as strings (command-line overrides); booleans are not numbers and
    nothing but a string is a string.
    """
    if key not in run_config:
        return default
    raw = run_config[key]
    try:
        if kind is bool:
            if isinstance(raw, str):
                if raw.lower() not in {"true", "false", "1", "0"}:
                    raise ValueError
                return raw.lower() in {"true", "1"}
            return bool(raw)
        if kind is str:
            if not isinstance(raw, str):
                raise TypeError
            return raw
        if isinstance(raw, bool) or (
            kind is int and isinstance(raw, float) and not raw.is_integer()
        ):
            raise ValueError
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"run config {key!r}: expected {kind.__name__}, got {raw!r}") from None


def run_dir(run_config: RunConfig, run_id: int) -> Path:
    """The folder of a run: ``<results-dir>/<run-name>``, where an empty run name becomes
    ``fed-<run id>`` — the server and the simulated sites derive the same folder."""
    name = get(run_config, "run-name", str, "") or f"fed-{run_id}"
    return Path(get(run_config, "results-dir", str, "results")) / name


def optional_path(run_config: RunConfig, key: str) -> str | None:
    value = get(run_config, key, str, "")
    return value or None


@dataclass(frozen=True)
class BackboneOptions:
    """Which frozen backbone pair every participant loads (their fingerprints must match)."""

    preset: str = "tiny"
    config_path: str | None = None
    clip_weights: str | None = None
    vit_weights: str | None = None

    @classmethod
    def from_run_config(cls, run_config: RunConfig) -> BackboneOptions:
        return cls(
            preset=get(run_config, "preset", str, "tiny"),
            config_path=optional_path(run_config, "backbone-config"),
            clip_weights=optional_path(run_config, "clip-weights"),
            vit_weights=optional_path(run_config, "vit-weights"),
        )

    def load(self) -> Backbones:
        return _load_backbones(self)


@cache
def _load_backbones(options: BackboneOptions) -> Backbones:
    """One backbone pair per process: simulation actors and a long-lived client reuse it."""
    return create_backbones(
        options.preset,
        config_path=options.config_path,
        clip_weights=options.clip_weights,
        vit_weights=options.vit_weights,
    )


def train_config(run_config: RunConfig) -> TrainConfig:
    """TrainConfig from run-config keys; per-round epochs for the federated stages."""
    d = TrainConfig()
    return TrainConfig(
        batch_size=get(run_config, "batch-size", int, d.batch_size),
        stage1_epochs=get(run_config, "stage1-epochs", int, d.stage1_epochs),
        stage2_epochs=get(run_config, "stage2-epochs", int, d.stage2_epochs),
        replay1_epochs=get(run_config, "replay1-epochs", int, d.replay1_epochs),
        replay2_epochs=get(run_config, "replay2-epochs", int, d.replay2_epochs),
        replay2_epochs_per_task=get(
            run_config, "replay2-epochs-per-task", int, d.replay2_epochs_per_task
        ),
        generative_replay=get(run_config, "generative-replay", bool, d.generative_replay),
        mixture_components=get(run_config, "mixture-components", int, d.mixture_components),
        confidence_modulation=get(
            run_config, "confidence-modulation", bool, d.confidence_modulation
        ),
        seed=get(run_config, "seed", int, d.seed),
    )


@dataclass(frozen=True)
class ProtocolOptions:
    """How the server drives the phases, and where a run keeps its federation."""

    stage1_rounds: int = 1
    stage2_rounds: int = 1
    timeout_s: float = 600.0
    wire_dtype: str = "float32"
    results_dir: str = "results"
    run_name: str | None = None
    federation_dir: str | None = None  # None: the run's folder (a simulation's own federation)
    max_steps: int = 0  # 0: until no site brings a new class
    min_sites: int = 1
    wait_s: float = 120.0  # for min_sites to connect
    server_test_dir: str | None = None  # an optional test set on the server

    @classmethod
    def from_run_config(cls, run_config: RunConfig) -> ProtocolOptions:
        options = cls(
            stage1_rounds=get(run_config, "stage1-rounds", int, 1),
            stage2_rounds=get(run_config, "stage2-rounds", int, 1),
            timeout_s=get(run_config, "timeout-s", float, 600.0),
            wire_dtype=get(run_config, "wire-dtype", str, "float32"),
            results_dir=get(run_config, "results-dir", str, "results"),
            run_name=optional_path(run_config, "run-name"),
            federation_dir=optional_path(run_config, "federation-dir"),
            max_steps=get(run_config, "max-steps", int, 0),
            min_sites=get(run_config, "min-sites", int, 1),
            wait_s=get(run_config, "wait-s", float, 120.0),
            server_test_dir=optional_path(run_config, "server-test-dir"),
        )
        if options.wire_dtype not in {"float32", "float16"}:
            raise ValueError("run config 'wire-dtype' must be float32 or float16")
        if options.stage1_rounds < 1 or options.stage2_rounds < 1:
            raise ValueError("run config stage rounds must be >= 1")
        return options
