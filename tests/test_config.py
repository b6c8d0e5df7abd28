"""The configuration schema: one definition per knob, one parser, one-line errors; the typed
options and pyproject.toml's run-config table derived from it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from starfed.cli.command_knobs import SCHEMA, TABLES, parse
from starfed.client import answer
from starfed.client.privacy import PrivacySetting
from starfed.server.app import run_server
from starfed.server.screening import ScreeningOptions
from starfed.shared.config import Options, ProtocolOptions
from starfed.shared.data.scenario import ScenarioConfig
from starfed.shared.knob import ConfigError, writable_dir
from starfed.shared.model.backbone_config import PRESETS, preset_config
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.training import TrainConfig
from starfed.shared.pyproject_table import with_run_config_table
from starfed.shared.retired_names import RUN_CONFIG as RETIRED
from starfed.shared.retired_names import current_keys
from starfed.simulations.train_local import LocalRunOptions

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
WRITE = [sys.executable, "-m", "starfed.shared.pyproject_table", "--write-pyproject"]


def test_pyproject_run_config_table_is_written_from_the_knobs() -> None:
    """The CI check: `python -m starfed.shared.pyproject_table --write-pyproject
    pyproject.toml` (make pyproject) writes the table; --check says whether it is written."""
    result = subprocess.run([*WRITE, str(PYPROJECT), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_writer_replaces_only_the_table_and_check_names_the_command(tmp_path: Path) -> None:
    text = PYPROJECT.read_text()
    stale = text.replace("num-tasks = 7\n", "num-tasks = 3  # edited by hand\nold-key = 1\n")
    assert stale != text and with_run_config_table(stale) == text  # every other byte kept
    path = tmp_path / "pyproject.toml"
    path.write_text(stale)
    result = subprocess.run([*WRITE, str(path), "--check"], capture_output=True, text=True)
    assert result.returncode == 1 and path.read_text() == stale
    assert result.stderr.strip().endswith(
        f"write it: python -m starfed.shared.pyproject_table --write-pyproject {path}"
    )
    assert subprocess.run([*WRITE, str(path)]).returncode == 0
    assert path.read_text() == text


def test_pyproject_holds_every_run_config_key_with_its_default() -> None:
    """What Flower needs: every key the apps read, with a default the schema accepts."""
    import tomllib

    app_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert list(app_config) == list(TABLES["run-config"])
    assert parse(app_config) == parse({})


def test_every_knob_is_read_from_its_own_tables_under_a_unique_key() -> None:
    """One table per knob, but a command option shared by several commands (Ray's, of
    simulate and experiment) lies in each of their tables: one knob, one check, one help."""
    assert sum(len(table) for table in TABLES.values()) == sum(
        len(knob.commands) or 1 for knob in SCHEMA
    )
    assert TABLES["experiment"]["ray-address"] is TABLES["simulate"]["ray-address"]
    for command in ("train-local", "simulate", "experiment"):  # flags may set either table
        assert not set(TABLES[command]) & set(TABLES["run-config"])


def _knobs_read(options: type[Options]) -> set[str]:
    return {f.metadata["knob"] for f in dataclasses.fields(options) if "knob" in f.metadata}


def _group(name: str) -> set[str]:
    return {k.key for k in SCHEMA if k.group == name}


def test_each_group_of_knobs_is_read_by_its_options() -> None:
    assert _knobs_read(ScenarioConfig) == _group("scenario")
    assert _knobs_read(ProtocolOptions) == _group("protocol")
    # + the run's privacy: whether sites' rows carry noise is the run's (or the registration's)
    # word, never a reply's; and what fixes a private site's DP-SGD, whose bound its rows are
    # held to (server/release_bounds.py); and the merge (the median's holds mixtures too)
    privacy = {"privacy-epsilon", "privacy-stage1-clip", "privacy-stage2-clip", "privacy-delta"}
    dp_sgd = {"stage1-epochs", "stage2-epochs", "batch-size", "merge"}
    assert _knobs_read(ScreeningOptions) == _group("screening") | privacy | dp_sgd
    # + train-local's single-site ablation (a federation's is its strategy, starfed-no-replay)
    assert _knobs_read(TrainConfig) == _group("training") | {"seed", "generative-replay"}
    assert _knobs_read(BackboneOptions) == _group("backbones") - {"device"}  # load(device)
    # + what a class's task plans releases for: the rounds, and DP-SGD's steps (epochs, batch)
    planned = {"stage1-rounds", "stage2-rounds", "stage1-epochs", "stage2-epochs", "batch-size"}
    assert _knobs_read(PrivacySetting) == _group("privacy") | planned


@pytest.mark.parametrize(
    "options",
    [
        ScenarioConfig,
        ProtocolOptions,
        ScreeningOptions,
        TrainConfig,
        BackboneOptions,
        LocalRunOptions,
        PrivacySetting,
    ],
)
def test_options_take_defaults_and_values_from_the_knobs(options: type[Options]) -> None:
    """Defaults are the knobs' (as parsed); set every knob to another value and each field
    follows it, with "" and 0 as None where a field is optional."""
    own = parse({}, "train-local")
    assert options.from_config(parse({}) | own) == options()
    others = {
        "preset": "paper",
        "wire-dtype": "float16",
        "device": "cpu",
        "vit-tag": "augreg",
        "replay-schedule": "bounded",
        "privacy-unit": "patient",
    }
    changed: dict[str, object] = {}
    for key, knob in {**TABLES["run-config"], **TABLES["train-local"]}.items():
        if knob.kind is bool:
            changed[key] = not knob.default
        elif knob.kind is str:
            changed[key] = others.get(key, f"/x/{key}")
        else:
            changed[key] = knob.default + 1
    made = options.from_config(changed)
    for field in dataclasses.fields(options):
        if "knob" in field.metadata:
            value = changed[field.metadata["knob"]]
            convert = field.metadata["convert"]
            assert getattr(made, field.name) == (convert(value) if convert else value)
            assert getattr(made, field.name) != getattr(options(), field.name), field.name
    assert LocalRunOptions.from_config(changed).train == TrainConfig.from_config(changed)


def test_optional_knobs_read_as_none() -> None:
    values = parse({})
    assert ProtocolOptions.from_config(values).run_name is None
    assert ScenarioConfig.from_config(values).classes_per_task is None
    assert BackboneOptions.from_config(values).clip_weights is None
    assert LocalRunOptions.from_config(values).cache_dir is None


def test_train_config_keeps_the_reference_values() -> None:
    """TrainConfig feeds training: its defaults may not move (the knobs' and the others')."""
    assert dataclasses.asdict(TrainConfig()) == {
        "batch_size": 128,
        "stage1_epochs": 5,
        "stage1_lr": 0.002,
        "lambda_op": 30.0,
        "stage2_epochs": 5,
        "stage2_lr": 0.001,
        "lambda_oq": 5.0,
        "replay1_epochs": 10,
        "replay1_lr": 0.01,
        "replay2_epochs": 10,
        "replay2_epochs_per_task": 5,
        "replay2_lr": 0.001,
        "replay_samples": 256,
        "replay_batch_size": 128,
        "replay_schedule": "auto",
        "replay1_steps": 25,
        "replay2_steps": 250,
        "mixture_components": 5,
        "generative_replay": True,
        "confidence_modulation": True,
        "seed": 1993,
    }
    changed = TrainConfig.from_config(parse({"stage1-epochs": 3, "replay2-epochs-per-task": 3}))
    assert changed.stage1_epochs == changed.replay2_epochs_per_task == 3


def test_text_and_typed_values_parse_alike() -> None:
    text = parse(
        {"num-tasks": "3", "alpha": "0.25", "confidence-modulation": "false", "seed": " 7"}
    )
    typed = parse({"num-tasks": 3, "alpha": 0.25, "confidence-modulation": False, "seed": 7})
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
        ({"num-sites": True}, "num-sites=true: expected an integer >= 1"),
        ({"timeout-s": 0}, "timeout-s=0: expected a number > 0"),
        ({"confidence-modulation": "maybe"}, "confidence-modulation=maybe: expected true or false"),
        ({"data-root": 3}, "data-root=3: expected a string"),
        ({"preset": "huge"}, "preset=huge: expected one of tiny, paper, paper-random"),
        (
            {"site-names": "7:farm-a 7:farm-b"},
            "site-names=7:farm-a 7:farm-b: expected NODE:NAME pairs, one per node, not '7:farm-b'",
        ),
    ],
)
def test_bad_values_are_one_line_naming_key_value_and_what_is_allowed(raw, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse(raw)
    assert str(err.value) == message


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"^unknown run-config key 'lr' \(known: data-root, "):
        parse({"lr": 0.1})
    # the single-site ablations are train-local's; a federation runs them as strategies
    with pytest.raises(ConfigError, match=r"^unknown run-config key 'generative-replay'"):
        parse({"generative-replay": False})
    with pytest.raises(ConfigError, match="unknown node-config key 'num-tasks'"):
        parse({"num-tasks": 2}, "node-config")


def test_a_retired_key_is_read_as_its_new_name_with_a_note(capsys) -> None:
    """``num-clients`` (``starfed.shared.retired_names``): the value of ``num-sites``, a note
    on stderr; both at once is one ConfigError; stored results read back without a note."""
    values = parse({"num-clients": "3", "alpha": 0.1})
    assert values["num-sites"] == 3 and "num-clients" not in values
    assert capsys.readouterr().err == (
        "starfed: num-clients is deprecated, use num-sites (same meaning)\n"
    )
    with pytest.raises(ConfigError, match=r"^num-clients=0: expected an integer >= 1$"):
        parse({"num-clients": 0})  # what the user wrote
    capsys.readouterr()
    with pytest.raises(ConfigError) as err:
        parse({"num-sites": 2, "num-clients": 2})
    assert (
        str(err.value)
        == "num-clients and num-sites both set: num-clients is the retired name of num-sites"
    )
    stored = {"alpha": 0.1, "num-clients": 3, "seed": 1}
    assert list(current_keys(stored, quiet=True).items()) == [
        ("alpha", 0.1),
        ("num-sites", 3),
        ("seed", 1),
    ]  # the same order
    assert capsys.readouterr().err == ""
    assert all(
        new in TABLES["run-config"] and old not in TABLES["run-config"]
        for old, new in RETIRED.items()
    )


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
        answer.site_for(1, 1, run_config, node_config)


def test_the_client_app_parses_a_node_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second message with the same node config is not parsed again; another node's config
    (a simulation's process answers many nodes) is parsed once too; a bad one fails every
    message."""
    from starfed.client import app

    parsed: list[dict] = []

    def counted(raw: dict, table: str) -> dict:
        parsed.append(dict(raw))
        return config_parse(raw, table)

    config_parse = app.parse
    monkeypatch.setattr(app, "parse", counted)
    app._worker_socket.cache_clear()
    node_a = {"partition-id": 0, "num-partitions": 2}
    node_b = {"partition-id": 1, "num-partitions": 2, "worker-socket": "/run/site.sock"}
    for node_config in (node_a, node_a, node_b, node_b, node_a):
        app._worker_socket(frozenset(node_config.items()))
    assert parsed == [node_a, node_b]
    assert app._worker_socket(frozenset(node_b.items())) == "/run/site.sock"
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"^unknown node-config key 'partition'"):
            app._worker_socket(frozenset({"partition": 0}.items()))
    assert len(parsed) == 4
    app._worker_socket.cache_clear()


def test_environment_knobs_are_read_typed_from_their_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``STARFED_<KEY>`` for each knob of the environment table: defaults when unset or empty,
    checked like every knob when set, and what the code that reads them gets."""
    from starfed.server.ops import layout
    from starfed.shared.config import environment, environment_variable

    for key in TABLES["environment"]:
        monkeypatch.delenv(environment_variable(key), raising=False)
    assert environment() == {
        "cache-dir": "",
        "server-dir": "",
        "fused-adam": False,
        "fast-towers": True,
    }
    assert answer.default_cache_dir() == Path.home() / ".cache" / "starfed"
    assert layout.default_dir() == Path(layout.DEFAULT_DIR)

    monkeypatch.setenv("STARFED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STARFED_SERVER_DIR", str(tmp_path / "server"))
    monkeypatch.setenv("STARFED_FUSED_ADAM", "1")
    assert environment()["fused-adam"] is True
    assert answer.default_cache_dir() == tmp_path / "cache"
    assert layout.default_dir() == tmp_path / "server"

    monkeypatch.setenv("STARFED_FUSED_ADAM", "maybe")
    with pytest.raises(ConfigError, match=r"^STARFED_FUSED_ADAM=maybe: expected true or false$"):
        environment()


def test_a_dropped_key_is_read_and_ignored_with_why(capsys) -> None:
    """``privacy-site-tasks`` planned a patient site's site-wide budget, which no longer exists:
    a script or stored run config that sets it still runs, with one line saying why."""
    values = parse({"privacy-site-tasks": 3, "alpha": 0.1})
    assert "privacy-site-tasks" not in values and values["alpha"] == 0.1
    assert capsys.readouterr().err.startswith("starfed: privacy-site-tasks is ignored: ")
    assert "privacy-site-tasks" not in current_keys({"privacy-site-tasks": 3}, quiet=True)
    assert capsys.readouterr().err == ""
