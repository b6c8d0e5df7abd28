"""The configuration schema: one definition per knob, one parser, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from starfed.client import app as client_app
from starfed.server.app import run_server
from starfed.shared.config import (
    SCHEMA,
    TABLES,
    BackboneOptions,
    ConfigError,
    ProtocolOptions,
    parse,
    writable_dir,
)
from starfed.shared.data.scenario import ScenarioConfig
from starfed.shared.model.backbone_config import PRESETS, preset_config
from starfed.shared.model.training import TrainConfig
from starfed.simulations.train_local import LocalRunOptions

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_pyproject_run_config_is_the_schema_defaults() -> None:
    app_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert list(app_config) == list(TABLES["run-config"])
    assert parse(app_config) == parse({})
    for key, value in app_config.items():  # same values, and TOML types the schema accepts
        assert value == TABLES["run-config"][key].default, key


def test_every_knob_is_read_from_one_table_under_a_unique_key() -> None:
    assert sum(len(table) for table in TABLES.values()) == len(SCHEMA)
    for command in ("train-local", "simulate"):  # a command's flags may set either table
        assert not set(TABLES[command]) & set(TABLES["run-config"])


def test_typed_options_agree_with_the_schema_defaults() -> None:
    values = parse({})
    assert TrainConfig.from_config(values) == TrainConfig()
    assert ScenarioConfig.from_config(values) == ScenarioConfig()
    assert ProtocolOptions.from_config(values) == ProtocolOptions()
    assert BackboneOptions.from_config(values) == BackboneOptions()
    assert LocalRunOptions.from_config(values, parse({}, "train-local")) == LocalRunOptions()


def test_every_training_knob_sets_a_train_config_field() -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    training = [k.key for k in SCHEMA if k.group == "training"]
    assert {key.replace("-", "_") for key in training} <= fields
    changed = TrainConfig.from_config(parse({key: 3 for key in training if "epochs" in key}))
    assert changed.stage1_epochs == changed.replay2_epochs_per_task == 3


def test_text_and_typed_values_parse_alike() -> None:
    text = parse({"num-tasks": "3", "alpha": "0.25", "generative-replay": "false", "seed": " 7"})
    typed = parse({"num-tasks": 3, "alpha": 0.25, "generative-replay": False, "seed": 7})
    assert text == typed
    assert parse({"alpha": 1})["alpha"] == 1.0 and isinstance(parse({"alpha": 1})["alpha"], float)
    assert parse({"min-sites": "2"})["min-sites"] == 2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"num-tasks": "abc"}, "num-tasks=abc: expected an integer >= 1"),
        ({"num-tasks": 0}, "num-tasks=0: expected an integer >= 1"),
        ({"alpha": -1}, "alpha=-1: expected a number > 0"),
        ({"alpha": "nan"}, "alpha=nan: expected a number > 0"),
        ({"seed": 1.5}, "seed=1.5: expected an integer in [0, 4294967295]"),
        ({"seed": "-1"}, "seed=-1: expected an integer in [0, 4294967295]"),
        ({"wire-dtype": "int8"}, "wire-dtype=int8: expected one of float32, float16"),
        ({"batch-size": 0}, "batch-size=0: expected an integer >= 1"),
        ({"stage1-epochs": -1}, "stage1-epochs=-1: expected an integer >= 0"),
        ({"num-clients": True}, "num-clients=true: expected an integer >= 1"),
        ({"timeout-s": 0}, "timeout-s=0: expected a number > 0"),
        ({"generative-replay": "maybe"}, "generative-replay=maybe: expected true or false"),
        ({"data-root": 3}, "data-root=3: expected a string"),
        ({"preset": "huge"}, "preset=huge: expected one of tiny, paper"),
    ],
)
def test_bad_values_are_one_line_naming_key_value_and_what_is_allowed(raw, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse(raw)
    assert str(err.value) == message


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"^unknown run-config key 'lr' \(known: data-root, "):
        parse({"lr": 0.1})
    with pytest.raises(ConfigError, match="unknown node-config key 'num-tasks'"):
        parse({"num-tasks": 2}, "node-config")


def test_messages_name_what_the_user_typed() -> None:
    with pytest.raises(ConfigError, match=r"^--tasks 0: expected an integer >= 1$"):
        parse({"num-tasks": "0"}, names={"num-tasks": "--tasks"})


def test_backbone_files_are_checked_where_they_enter(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(preset_config("tiny").to_json())
    assert parse({"backbone-config": str(good)})["backbone-config"] == str(good)
    cases = {
        "garbage.json": ("not json {", "not a JSON file (Expecting value"),
        "keys.json": (json.dumps({"name": "x", "colour": "red"}), "unknown backbone config keys"),
        "list.json": ("[1, 2]", "not a JSON object"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"^backbone-config={tmp_path / name}: ") as err:
            parse({"backbone-config": str(tmp_path / name)})
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"missing\.json: no such file$"):
        parse({"backbone-config": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match=r"clip-weights=.*: no such file$"):
        parse({"clip-weights": str(tmp_path / "clip.safetensors")})


def test_writable_dir_creates_or_refuses(tmp_path: Path) -> None:
    assert writable_dir(tmp_path / "a" / "b", "results-dir").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--results-dir .*file/r: cannot write there \(Not a"):
        writable_dir(tmp_path / "file" / "r", "--results-dir")


def test_presets_are_the_schema_choices() -> None:
    assert TABLES["run-config"]["preset"].choices == PRESETS
    for preset in PRESETS:
        assert preset_config(preset).name == preset


# --- the apps validate too: `flwr run .` may start them without `starfed simulate` -----------


class NoGrid:
    """A grid the ServerApp must not reach: a bad run config fails before it."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the ServerApp used the grid ({name}) despite a bad run config")


def test_server_app_rejects_a_bad_run_config_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^alpha=-1.0: expected a number > 0$"):
        run_server(NoGrid(), {"alpha": -1.0, "results-dir": str(tmp_path)})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot write there"):
        run_server(NoGrid(), {"results-dir": str(tmp_path / "file" / "results")})


@pytest.mark.parametrize(
    ("run_config", "node_config", "message"),
    [
        ({"wire-dtype": "int8"}, {}, "wire-dtype=int8: expected one of float32, float16"),
        ({}, {"partition-id": -1}, "partition-id=-1: expected an integer >= 0"),
        ({}, {"num-partitions": "two"}, "num-partitions=two: expected an integer >= 0"),
        ({}, {"cache-dir": 5}, "cache-dir=5: expected a string"),
        ({}, {"partition": 0}, "unknown node-config key 'partition'"),
    ],
)
def test_client_app_checks_run_and_node_config(
    monkeypatch, run_config, node_config, message
) -> None:
    monkeypatch.setattr(BackboneOptions, "load", lambda self: pytest.fail("backbones loaded"))
    with pytest.raises(ConfigError, match=f"^{message}"):
        client_app.site_for(1, 1, run_config, node_config)
