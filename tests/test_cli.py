"""The command line: flags generated from the schema, and every bad input reported as one line
with exit code 2 before any model, data or Flower process is loaded."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import starfed.shared.model.backbones
import starfed.simulations.train_local
from starfed.cli import build_parser, main
from starfed.cli import experiment as experiment_cli
from starfed.cli import simulate as simulate_cli
from starfed.cli import train_local as train_local_cli
from starfed.cli.command_knobs import TABLES
from starfed.ops.exit_codes import EXIT_PIPE_CLOSED
from starfed.shared.codebook import wire
from starfed.shared.knob import show

FLAG_NAMES = {
    "train-local": "--data-root --tasks --classes-per-task --seed --cache-dir --preset "
    "--backbone-config --clip-weights --vit-weights --download --vit-tag --epochs --batch-size "
    "--replay-epochs --no-generative-replay --unimodal --no-confidence-modulation "
    "--classify-with-keys --results-dir --run-name --threads",
    "simulate": "--sites --tasks --classes-per-task --alpha --seed --arrival-offset "
    "--stage1-rounds --stage2-rounds --epochs --results-dir --run-name --run-config --runtime "
    "--timeout --gpus-per-client --ray-address --resume --follow",
    "experiment": "--results-dir --runtime --timeout --gpus-per-client --ray-address --json",
}
FLAGS = {
    "train-local": train_local_cli.FLAGS,
    "simulate": simulate_cli.FLAGS,
    "experiment": experiment_cli.FLAGS,
}
FAST_S = 2.0


def _options(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: a for a in subparsers.choices[command]._actions for name in a.option_strings}


@pytest.mark.parametrize("command", list(FLAG_NAMES))
def test_flag_names_are_kept_and_help_shows_the_real_defaults(command: str) -> None:
    options = _options(command)
    assert set(FLAG_NAMES[command].split()) <= set(options)
    knobs = {**TABLES["run-config"], **TABLES[command]}
    for flag in FLAGS[command]:
        default = knobs[flag.keys[0]].default
        assert options[flag.name].help.endswith(f"(default: {show(default)})"), flag.name


def _help(capsys, command: str) -> str:
    """``starfed COMMAND --help`` with its lines joined: wrapping does not split a phrase."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_text(capsys) -> None:
    text = _help(capsys, "train-local")
    assert "--epochs EPOCHS local epochs of stages 1 and 2 (default: 5)" in text
    assert "--batch-size BATCH_SIZE training batch size (default: 128)" in text
    assert "--no-generative-replay ablation (paper, Tab. 3): generative-replay=false" in text
    text = _help(capsys, "simulate")
    assert "--sites SITES sites (in simulation: SuperNodes) (default: 5)" in text
    assert "--clients" not in text  # its retired name works, unlisted
    assert "--alpha ALPHA Dirichlet concentration" in text and "(default: 0.5)" in text
    text = _help(capsys, "experiment")
    assert "--runtime {flower,local} where the starfed cells' federations run" in text
    assert "(default: local)" in text
    assert "--ray-address RAY_ADDRESS an existing Ray cluster to run the simulated clients" in text
    assert "--ray-address (or RAY_ADDRESS) runs its clients on an existing Ray cluster" in text


@pytest.fixture
def nothing_heavy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if a command gets past its checks to the run, backbones or Flower."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("loaded despite bad input")

    monkeypatch.setattr(starfed.simulations.train_local, "run_local", refuse)
    monkeypatch.setattr(starfed.simulations.train_local, "create_backbones", refuse)
    monkeypatch.setattr(starfed.shared.model.backbones, "create_backbones", refuse)
    monkeypatch.setattr(simulate_cli, "simulate", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _fails_at_once(argv: list[str], capsys) -> str:
    """Run the CLI; check exit code 2, a single stderr line and speed; return that line."""
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < FAST_S
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    (tmp_path / "garbage.json").write_text("not json at all")
    (tmp_path / "keys.json").write_text('{"name": "x", "colour": "red"}')
    (tmp_path / "file").write_text("")
    return tmp_path


UNWRITABLE = "--results-dir {tmp}/file/results: cannot write there (Not a directory)"
DEVICES = "expected auto, cpu, cuda, cuda:N or mps"
#: command (and the arguments it needs) -> the lines bad flags give; each line starts with what
#: was typed: the flags, or a `--run-config` pair.
BAD_INPUT = {
    "train-local": [
        "--batch-size 0: expected an integer >= 1",
        "--seed -1: expected an integer in [0, 4294967295]",
        "--tasks 0: expected an integer >= 1",
        "--epochs -1: expected an integer >= 0",
        "--threads 0: expected an integer >= 1",
        "--preset huge: expected one of tiny, paper, paper-random",
        "--backbone-config {tmp}/garbage.json: not a JSON file (Expecting value: line 1 column 1 "
        "(char 0))",
        "--backbone-config {tmp}/keys.json: unknown backbone config keys: ['colour']",
        "--backbone-config {tmp}/missing.json: no such file",
        "--data-root {tmp}/no-such: no such folder",
        UNWRITABLE,
    ],
    "simulate --runtime local": ["data-root={tmp}/no-such: no such folder"],
    "simulate": [
        "data-root={tmp}/no-such: no such folder",
        "num-tasks=abc: expected an integer >= 1",
        "alpha=-1: expected a number > 0",
        "seed=1.5: expected an integer in [0, 4294967295]",
        "wire-dtype=int8: expected one of float32, float16",
        "num-tasks=0: expected an integer >= 1",
        "batch-size=0: expected an integer >= 1",
        "min-sites=0: expected an integer >= 1",
        "--run-config seed: expected KEY=VALUE",
        "--sites 0: expected an integer >= 1",
        "--alpha 0: expected a number > 0",
        "--timeout -5: expected a number > 0",
        "--runtime ray: expected one of flower, local",
        UNWRITABLE,
    ],
    "experiment --results-dir {tmp}/results sites": [
        "--runtime ray: expected one of flower, local",
        "--timeout 0: expected a number > 0",
        "--gpus-per-client -1: expected a number >= 0",
        "--ray-address ray://h:1: expected host:port of a Ray cluster's head (not a Ray Client "
        "ray://)",
    ],
    "site start --server h:1 --data {tmp}": [f"--device cudax: {DEVICES}"],
    "server start --dir {tmp}/server": [
        "--internal-port 0: expected an integer in [1, 65535]",
        "--listen nowhere: expected HOST:PORT, got 'nowhere'",
        "--isolation thread: expected one of process, subprocess",
        "--max-body-mib 0: expected an integer >= 1",
    ],
    "server serve --dir {tmp}/server --federation {tmp}": [
        "--max-mib 0: expected an integer >= 1",
        "--listen :1: expected HOST:PORT, got ':1'",
    ],
    "predict --codebook {tmp}/file {tmp}/file": [
        "--batch-size 0: expected an integer >= 1",
        "--format xml: expected one of csv, json",
        f"--device gpu: {DEVICES}",
    ],
}


@pytest.mark.parametrize(
    ("command", "line"), [(command, line) for command, lines in BAD_INPUT.items() for line in lines]
)
def test_bad_input(command, line, bad_files, nothing_heavy, capsys) -> None:
    """Every flag is checked by the knob table at start: one line, exit 2, nothing loaded."""
    typed = line.partition(": ")[0]
    flags = typed.split() if typed.startswith("--") else ["--run-config", typed]
    argv = [arg.format(tmp=bad_files) for arg in [*command.split(), *flags]]
    words = command.partition(" -")[0]  # the command's words, before its arguments
    got = _fails_at_once(argv, capsys)
    assert got == f"starfed {words}: error: {line.format(tmp=bad_files)}"


def test_usage_errors_are_one_line_too(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train-local", "--tasks"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "starfed train-local: error: argument --tasks: expected one argument (see --help)\n"
    )


def test_simulate_unknown_key(nothing_heavy, capsys) -> None:
    line = _fails_at_once(["simulate", "--run-config", "learning-rate=0.1"], capsys)
    assert line.startswith(
        "starfed simulate: error: unknown run-config key 'learning-rate' (known: data-root, "
    )


def _submitted(capsys, *argv: str) -> tuple[dict, list[str]]:
    """The run config ``starfed simulate ARGV`` would submit, and the lines on stderr."""
    overrides = simulate_cli.build_overrides(build_parser().parse_args(["simulate", *argv]))
    return overrides, capsys.readouterr().err.splitlines()


def test_retired_site_count_names_work_with_a_note(capsys) -> None:
    """``--clients`` and the run-config key ``num-clients`` set ``num-sites``, each saying the
    new name in one line; what is submitted holds only the new key."""
    overrides, err = _submitted(capsys, "--clients", "3")
    assert overrides["num-sites"] == 3 and "num-clients" not in overrides
    assert err == ["starfed: --clients is deprecated, use --sites (same meaning)"]
    overrides, err = _submitted(capsys, "--run-config", "num-clients=4")
    assert overrides["num-sites"] == 4 and "num-clients" not in overrides
    assert err == ["starfed: num-clients is deprecated, use num-sites (same meaning)"]
    overrides, err = _submitted(capsys, "--sites", "2", "--run-config", "num-clients=4")
    assert overrides["num-sites"] == 2  # named options win, as with the new key
    overrides, err = _submitted(capsys, "--sites", "2")
    assert overrides["num-sites"] == 2 and err == []


def test_both_names_of_the_site_count_are_one_line(nothing_heavy, capsys) -> None:
    line = _fails_at_once(
        ["simulate", "--run-config", "num-clients=4", "--run-config", "num-sites=3"], capsys
    )
    assert line == (
        "starfed simulate: error: num-clients and num-sites both set: num-clients is the retired "
        "name of num-sites"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--sites", "3", "--clients", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "starfed simulate: error: argument --clients: not allowed with argument --sites "
        "(see --help)"
    )


def test_a_fresh_process_reports_bad_input_without_loading_torch_or_flower(bad_files) -> None:
    """What a user sees: the answer comes before torch, Flower or Ray are even imported."""
    code = (
        "import sys; from starfed.cli import main; rc = main(sys.argv[1:]); "
        "print(rc, *sorted(m for m in ('torch', 'flwr', 'ray') if m in sys.modules))"
    )
    for argv in (
        ["simulate", "--run-config", "alpha=-1"],
        ["train-local", "--batch-size", "0"],
        ["train-local", "--backbone-config", str(bad_files / "keys.json")],
        ["site", "start", "--server", "h:1", "--data", str(bad_files), "--device", "cudax"],
    ):
        result = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert result.stdout.split() == ["2"], (argv, result.stdout, result.stderr)
        assert result.stderr.count("\n") == 1 and "error:" in result.stderr, result.stderr


def test_a_class_without_readable_training_images_is_one_line(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    for name in ("good", "bad"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(3):
            path = tmp_path / "data" / name / f"{i}.jpg"
            if name == "bad":
                path.write_bytes(b"garbage bytes, not a jpeg")
            else:
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    argv = ["train-local", "--data-root", str(tmp_path / "data"), "--tasks", "1"]
    assert main([*argv, "--results-dir", str(tmp_path / "results")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"starfed train-local: error: class folder {tmp_path / 'data' / 'bad'} has no readable "
        "image (2 unreadable files)"
    )


def test_gpus_per_client_needs_a_gpu_and_the_flower_runtime(
    tmp_path, nothing_heavy, capsys
) -> None:
    argv = ["simulate", "--results-dir", str(tmp_path), "--gpus-per-client", "0.5"]
    line = _fails_at_once([*argv, "--runtime", "local"], capsys)
    assert line.startswith("starfed simulate: error: --gpus-per-client is Ray's")
    if not torch.cuda.is_available():
        line = _fails_at_once(argv, capsys)
        assert (
            line == "starfed simulate: error: --gpus-per-client 0.5: this machine has no CUDA GPU"
        )
    line = _fails_at_once(["simulate", "--gpus-per-client", "-1"], capsys)
    assert "--gpus-per-client" in line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--ray-address", "127.0.0.1:6379"],
            "--ray-address is Ray's: the local runtime runs without Ray (--runtime flower)",
        ),
        (["--gpus-per-client", "0.5"], "--gpus-per-client is Ray's: the local runtime computes"),
    ],
)
def test_experiment_takes_ray_options_on_the_flower_runtime_only(
    argv: list[str], line: str, tmp_path, nothing_heavy, capsys
) -> None:
    """The same check as simulate's: Ray's options with cells on the local runtime (the
    experiment's default) are bad input, before any cell runs."""
    got = _fails_at_once(["experiment", "sites", "--results-dir", str(tmp_path), *argv], capsys)
    assert got.startswith(f"starfed experiment: error: {line}"), got


def test_experiment_on_flower_refuses_methods_of_the_local_runtime(
    tmp_path, nothing_heavy, capsys
) -> None:
    argv = ["experiment", "default", "--results-dir", str(tmp_path), "--runtime", "flower"]
    assert _fails_at_once(argv, capsys) == (
        "starfed experiment: error: --runtime flower: methods starfed-positional, "
        "starfed-unmerged, starfed-no-replay, starfed-keys, fedavg, single-site, joint run on "
        "the local runtime only (Flower runs starfed): give them a grid of their own"
    )


def test_each_key_mix_up_is_one_line_naming_it(tmp_path, nothing_heavy, capsys) -> None:
    """The private key given where the public one goes, and the other way round (issue 47)."""
    from starfed.ops import pki

    pki.write_site_key(tmp_path / "site.key", "site@host")
    start = ["site", "start", "--server", "127.0.0.1:1", "--ca", str(tmp_path / "site.pub")]
    argv = [*start, "--key", str(tmp_path / "site.pub"), "--data", str(tmp_path)]
    line = _fails_at_once(argv, capsys)
    assert line == (
        f"starfed site start: error: {tmp_path / 'site.pub'} is the public key: --key takes the "
        "private key beside it (site.key); the .pub is what the operator registers"
    )
    add = ["server", "sites", "add", "farm-a", str(tmp_path / "site.key"), "--dir", str(tmp_path)]
    assert _fails_at_once(add, capsys) == (
        f"starfed server sites add: error: {tmp_path / 'site.key'} is a private key: register "
        "the site's public key (site.pub); a private key stays at its site"
    )


def test_a_sites_declared_privacy_is_a_number_over_0_with_its_unit(
    tmp_path, nothing_heavy, capsys
) -> None:
    from starfed.ops import pki

    pki.write_site_key(tmp_path / "site.key", "site@host")
    add = ["server", "sites", "add", "farm-a", str(tmp_path / "site.pub"), "--dir", str(tmp_path)]
    assert _fails_at_once([*add, "--privacy-epsilon", "0"], capsys) == (
        "starfed server sites add: error: --privacy-epsilon 0: a number over 0"
    )
    assert _fails_at_once([*add, "--privacy-unit", "patient"], capsys) == (
        "starfed server sites add: error: --privacy-unit goes with --privacy-epsilon (the ε it "
        "protects)"
    )


def test_a_mistyped_flag_is_named_not_the_required_one_it_hides(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["site", "start", "--sever", "127.0.0.1:1", "--data", "."])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "starfed site start: error: unknown flag --sever (did you mean --server?) (see --help)\n"
    )


def test_status_of_a_server_folder_that_is_not_there_says_so(tmp_path, capsys) -> None:
    """A typo'd --dir is bad input, not a stopped server."""
    line = _fails_at_once(["server", "status", "--dir", str(tmp_path / "nope")], capsys)
    assert line == (
        f"starfed server status: error: no server folder {tmp_path / 'nope'} (--dir "
        f"{tmp_path / 'nope'}); `starfed server start` makes one; a simulation's folder: "
        "--federation DIR"
    )


def test_an_interrupted_simulation_continues_with_resume(tmp_path, monkeypatch, capsys) -> None:
    """Its own settings, saved in its folder, submitted again to the same folder (issue 47)."""
    submitted: list[dict] = []
    monkeypatch.setattr(simulate_cli, "simulate", lambda overrides, *_: submitted.append(overrides))
    run = tmp_path / "r"
    argv = ["simulate", "--results-dir", str(tmp_path), "--run-name", "r"]
    assert main([*argv, "--sites", "2"]) == 0
    (run / "interrupted.json").write_text("{}")
    line = _fails_at_once(argv, capsys)
    assert line.endswith(f"or continue an interrupted one with `starfed simulate --resume {run}`")
    line = _fails_at_once(["simulate", "--resume", str(run), "--sites", "3"], capsys)
    assert line.endswith("error: --resume continues a run with its own settings: drop --sites")
    assert main(["simulate", "--resume", str(run), "--timeout", "60"]) == 0
    assert submitted[1] == submitted[0] and submitted[0]["num-sites"] == 2
    assert not (run / "interrupted.json").exists()
    line = _fails_at_once(["simulate", "--resume", str(tmp_path)], capsys)
    assert line.startswith(f"starfed simulate: error: --resume {tmp_path}: no readable simulation")


def into_a_closed_pipe(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """``starfed ARGV`` in its own process, its stdout a pipe whose reader is closed before the
    first write (``starfed … | true``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-P", "-m", "starfed.cli", *map(str, argv)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)


def test_a_reader_that_went_away_is_no_traceback(tmp_path: Path, make_codebook) -> None:
    """``starfed predict … | head`` printed a BrokenPipeError traceback once ``head`` had its
    lines, and a guarded command such as ``site keygen`` "error: [Errno 32] Broken pipe"
    (issue 47's walkthrough): the command stops quietly with the shell's code for SIGPIPE. A
    command printing through rich's console (``codebook inspect``; ``evaluate`` in
    tests/test_inference.py) exited 1 without a word, rich's own answer."""
    result = into_a_closed_pipe("site", "keygen", "--out", tmp_path / "site.key")
    assert (result.returncode, result.stderr) == (EXIT_PIPE_CLOSED, "")
    assert (tmp_path / "site.pub").is_file()  # what it did, it did; only its report was lost
    wire.write_file(tmp_path / "codebook.bin", make_codebook())
    result = into_a_closed_pipe("codebook", "inspect", tmp_path / "codebook.bin")
    assert (result.returncode, result.stderr) == (EXIT_PIPE_CLOSED, "")


def test_following_a_run_with_no_superlink_there_is_one_line(capsys, monkeypatch) -> None:
    """``starfed simulate --follow RUN_ID`` with nothing at the local SuperLink's port."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", str(port))
    assert main(["simulate", "--follow", "123"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"starfed simulate: error: --follow 123 on 127.0.0.1:{port}: "), err
    assert err.count("\n") == 1
