"""Export, predict and evaluate on a federation trained in process (docs/inference.md).

One federation for the module: two sites with two classes each, one step, tiny backbones, and a
server test set of every bundled test image of those four classes (``server-test-dir``). The
comparison with the server is exact: the same images and the same codebook, predicted in one
batch as the server's evaluation does, so even the float rounding is the same.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from starfed.cli import main
from starfed.client import app as client_app
from starfed.ops.exit_codes import EXIT_PIPE_CLOSED
from starfed.ops.follow import CACHE_FILE
from starfed.ops.processes import free_port
from starfed.proto import codebook_pb2 as pb
from starfed.server.federation import Federation
from starfed.server.ops.certs import ensure_certificates
from starfed.server.ops.layout import ServerFolder
from starfed.server.records import Position
from starfed.server.serving import distribution
from starfed.server.serving.distribution import ServeOptions
from starfed.server.serving.export import card_path
from starfed.shared.codebook import wire
from starfed.shared.codebook.deployment import CLASS_STEPS_KEY
from starfed.shared.codebook.framing import read_payload
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.data.site_folder import class_key
from starfed.simulations.local_grid import LocalGrid

sys.path.insert(0, str(Path(__file__).parent))
from conftest import random_entries
from in_process import TINY_RUN, run_grid, starfed
from site_folders import BUNDLED, CLASSES, site_folder
from test_cli import into_a_closed_pipe

TRAINED = CLASSES[0:4]
ONE_BATCH = "256"  # >= the test images: one forward pass, like the server's evaluation


@pytest.fixture(scope="module")
def federation(tmp_path_factory) -> dict:
    """A federation folder after one step of two sites, and the server's record of it."""
    tmp = tmp_path_factory.mktemp("inference")
    test_dir = tmp / "server-test"
    test_dir.mkdir()
    for name in TRAINED:
        (test_dir / name).symlink_to(BUNDLED / "test" / name)
    nodes = {}
    for node, (site, classes) in enumerate((("farm-a", TRAINED[:2]), ("farm-b", TRAINED[2:])), 1):
        data = site_folder(tmp / site / "data", {"t1": classes})
        nodes[node] = {
            "data-dir": str(data),
            "state-dir": str(tmp / site / "state"),
            "site-name": site,
            "cache-dir": str(tmp / "cache"),
        }
    config = {
        **TINY_RUN,
        "federation-dir": str(tmp / "federation"),
        "server-test-dir": str(test_dir),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grid = LocalGrid(client_app.app, config, nodes, run_id=7001)
        metrics = run_grid(grid, config)
    finally:
        torch.set_num_threads(threads)
    assert metrics["status"] == "completed"
    history = Federation.open(tmp / "federation").history()
    return {"dir": tmp / "federation", "test": test_dir, "tmp": tmp, "record": history[-1]}


@pytest.fixture(scope="module")
def exported(federation) -> Path:
    out = federation["tmp"] / "export" / "codebook.bin"
    out.parent.mkdir()
    argv = ["server", "export", "--federation", str(federation["dir"]), "--out", str(out)]
    assert main(argv) == 0
    return out


def accuracy(rows: list[dict]) -> float:
    """% of images whose predicted class is their folder's."""
    hits = sum(class_key(Path(r["path"]).parent.name) == class_key(r["class"]) for r in rows)
    return 100.0 * hits / len(rows)


# --- export ---------------------------------------------------------------------------------


def test_export_holds_what_devices_need_and_a_model_card(federation, exported, capsys):
    codebook = wire.read_file(exported)
    message = pb.Codebook.FromString(read_payload(exported))
    assert sorted(codebook.names) == sorted(TRAINED) and codebook.frozen == set(TRAINED)
    assert not any(e.HasField("clip_mixture") or e.HasField("vit_mixture") for e in message.entries)
    assert not any(e.field_versions for e in message.entries)
    assert codebook.version == federation["record"].codebook_version
    assert json.loads(codebook.metadata[CLASS_STEPS_KEY]) == dict.fromkeys(TRAINED, 0)
    assert "position" not in codebook.metadata  # no server bookkeeping, but its version line:
    lineage = Lineage.of(wire.read_file(federation["dir"] / "codebook.bin"))
    assert Lineage.of(codebook) == lineage and lineage.epoch  # (a device's deltas follow it)

    card = json.loads(card_path(exported).read_text())
    metrics = json.loads((federation["dir"] / "metrics.json").read_text())
    assert card["codebook"]["version"] == codebook.version
    assert card["codebook"]["bytes"] == exported.stat().st_size
    assert card["backbones"]["fingerprint"] == codebook.fingerprint
    assert card["backbones"]["config"] == "tiny"
    # steps are 1-based wherever users see them; the metadata above keeps the 0-based index
    assert {c["name"]: (c["step"], sorted(c["sites"])) for c in card["classes"]} == {
        **{n: (1, ["farm-a"]) for n in TRAINED[:2]},
        **{n: (1, ["farm-b"]) for n in TRAINED[2:]},
    }
    assert card["metrics"]["final_average_accuracy"] == metrics["final_average_accuracy"]
    assert card["metrics"]["accuracy_matrix"] == metrics["accuracy_matrix"]
    assert card["left_out"] == [] and card["starfed_version"]

    # A value of what the federation finished: the same bytes again; float16 is half the size.
    again = exported.with_name("again.bin")
    code, out, _ = starfed(
        capsys,
        "server",
        "export",
        "--federation",
        federation["dir"],
        "--out",
        again,
        "--float16",
        "--json",
    )
    assert code == 0 and json.loads(out)["codebook"]["dtype"] == "float16"
    half = wire.read_file(again)
    assert again.stat().st_size < 0.6 * exported.stat().st_size
    for name in codebook.names:
        for field, value in codebook[name].values.items():
            assert torch.allclose(half[name].values[field], value, rtol=2**-10, atol=1e-6)


def test_a_step_in_progress_is_left_out_and_named(federation, exported, tmp_path, capsys):
    folder = tmp_path / "server" / "federation"  # the server folder's: no --federation needed
    shutil.copytree(federation["dir"], folder)
    fed = Federation.open(folder)
    codebook = fed.checkpoints.codebook()
    half_trained = random_entries(codebook.dims, n_classes=2, prefix="new", mixtures=False)
    fed.register([e.name for e in half_trained], 1, {"new_0": ["farm-a"], "new_1": ["farm-a"]})
    fed.checkpoint(codebook.register(half_trained), Position(1, running=True, done=("stage1/0",)))
    out = tmp_path / "cb.bin"
    code, text, _ = starfed(capsys, "server", "export", "--dir", folder.parent, "--out", out)
    assert code == 0
    assert "left out (step in progress, not finished): new_0, new_1" in text
    assert out.read_bytes() == exported.read_bytes()  # exactly the frozen classes
    assert json.loads(card_path(out).read_text())["left_out"] == ["new_0", "new_1"]


def test_export_refuses_what_is_not_a_federation(tmp_path, capsys):
    code, out, err = starfed(capsys, "server", "export", "--federation", tmp_path)
    assert code == 2 and out == ""
    assert (
        err == f"starfed server export: error: {tmp_path} is not a federation folder (no "
        "federation.json)\n"
    )


# --- predict and evaluate ---------------------------------------------------------------------


def test_predict_and_evaluate_give_the_servers_accuracy(federation, exported, tmp_path, capsys):
    server = federation["record"].server_eval
    code, out, err = starfed(
        capsys, "predict", "--codebook", exported, "--batch-size", ONE_BATCH, federation["test"]
    )
    assert (code, err) == (0, "")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 20 * len(TRAINED)
    assert accuracy(rows) == server.accuracy[0]
    assert {r["task"] for r in rows} == {"1"} and {r["class"] for r in rows} <= set(TRAINED)
    assert all(0 < float(r["probability"]) <= 1 for r in rows)

    plot = tmp_path / "confusion.png"
    code, out, _ = starfed(
        capsys,
        "evaluate",
        "--codebook",
        exported,
        "--data",
        federation["test"],
        "--plot",
        plot,
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and result["images"] == len(rows)
    assert result["accuracy"] == result["tasks"][0]["accuracy"] == server.accuracy[0]
    assert result["tasks"][0]["selection_accuracy"] == server.selection_accuracy[0]
    assert result["tasks"][0]["step"] == 1 and {c["step"] for c in result["classes"]} == {1}
    assert result["left_out"] == {} and result["unreadable"] == 0
    confusion = torch.tensor(result["confusion_matrix"])
    assert int(confusion.sum()) == len(rows)
    assert int(confusion.trace()) == sum(c["correct"] for c in result["classes"])
    by_class = {c["name"]: c for c in result["classes"]}
    for name in TRAINED:  # per class: the same counts as the CSV's
        mine = [r for r in rows if Path(r["path"]).parent.name == name]
        assert by_class[name]["images"] == len(mine) == 20
        assert by_class[name]["correct"] == sum(r["class"] == name for r in mine)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code, out, _ = starfed(
        capsys, "evaluate", "--codebook", exported, "--data", federation["test"], "--plot", plot
    )
    assert code == 0 and f"accuracy {server.accuracy[0]:.2f}%" in out and str(plot) in out


def test_evaluate_leaves_out_classes_the_codebook_lacks(federation, exported, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in (TRAINED[0], CLASSES[9]):
        (data / name).symlink_to(BUNDLED / "test" / name)
    code, out, _ = starfed(
        capsys,
        "evaluate",
        "--codebook",
        exported,
        "--data",
        data,
        "--plot",
        tmp_path / "c.png",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and result["images"] == 20
    assert result["left_out"] == {CLASSES[9]: 20}  # as the folder names it
    assert [t["images"] for t in result["tasks"]] == [20]
    assert {c["name"]: c["accuracy"] is None for c in result["classes"]}[TRAINED[1]]
    code, out, _ = starfed(
        capsys, "evaluate", "--codebook", exported, "--data", data, "--plot", tmp_path / "c.png"
    )
    assert code == 0 and "codebook v" in out and " on " in out and ": 20 images · " in out
    assert f"left out: 20 images of 1 class the codebook lacks ({CLASSES[9]})" in out


def test_evaluate_into_a_reader_that_went_away_exits_as_predict_does(
    federation, exported, tmp_path
):
    """``starfed evaluate … | true`` exited 1 without a word (rich's answer to a closed pipe)
    where ``predict … | head`` exits 141 (issue 47)."""
    plot = tmp_path / "c.png"
    result = into_a_closed_pipe(
        "evaluate", "--codebook", exported, "--data", federation["test"], "--plot", plot
    )
    assert (result.returncode, result.stderr) == (EXIT_PIPE_CLOSED, "")
    assert plot.is_file()  # what it did, it did; only its report was lost


def test_predict_json_and_one_warning_per_unreadable_image(exported, tmp_path, capsys):
    images = [str(sorted((BUNDLED / "test" / name).iterdir())[0]) for name in TRAINED[:2]]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image at all")
    code, out, err = starfed(
        capsys, "predict", "--codebook", exported, "--format", "json", images[0], broken, images[1]
    )
    assert code == 0
    assert err == f"starfed predict: warning: cannot read {broken}: skipped\n"
    result = json.loads(out)
    assert [p["path"] for p in result["predictions"]] == images
    assert result["skipped"] == [str(broken)]
    assert set(result["predictions"][0]) == {"path", "class", "probability", "task"}
    assert result["codebook"]["classes"] == len(TRAINED)

    code, out, err = starfed(capsys, "predict", "--codebook", exported, broken)
    assert code == 2
    assert err.splitlines() == [
        f"starfed predict: warning: cannot read {broken}: skipped",
        "starfed predict: error: none of the 1 image could be read",
    ]


def test_evaluate_warns_of_an_unreadable_image_as_predict_does(exported, tmp_path, capsys):
    data = tmp_path / "data"
    (data / TRAINED[0]).mkdir(parents=True)
    for image in sorted((BUNDLED / "test" / TRAINED[0]).iterdir())[:2]:
        (data / TRAINED[0] / image.name).symlink_to(image)
    broken = data / TRAINED[0] / "broken.jpg"
    broken.write_bytes(b"not an image at all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning reaches the user
        code, out, err = starfed(
            capsys,
            "evaluate",
            "--codebook",
            exported,
            "--data",
            data,
            "--plot",
            tmp_path / "c.png",
            "--json",
        )
    assert code == 0
    assert err == f"starfed evaluate: warning: cannot read {broken}: skipped\n"
    result = json.loads(out)
    assert result["images"] == 2 and result["unreadable"] == 1
    assert result["unreadable_files"] == [str(broken)]


def test_a_codebook_of_other_backbones_is_one_line_and_exit_2(exported, tmp_path, capsys):
    codebook = replace(wire.read_file(exported), fingerprint="cd" * 32)
    other = tmp_path / "other.bin"
    wire.write_file(other, codebook)
    image = sorted((BUNDLED / "test" / TRAINED[0]).iterdir())[0]
    code, out, err = starfed(capsys, "predict", "--codebook", other, image)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(
        "starfed predict: error: the codebook was trained with other backbones (fingerprint "
        "cdcdcdcdcdcd…, these are "
    )


def test_predict_input_errors_are_one_line_and_exit_2(exported, tmp_path, capsys):
    for argv, message in (
        ([tmp_path / "x.jpg"], "give either --codebook FILE or --from HOST:PORT"),
        (
            ["--codebook", exported, tmp_path / "x.jpg"],
            f"{tmp_path / 'x.jpg'}: no such file or folder",
        ),
        (
            ["--codebook", exported, "--from", "h:1", tmp_path],
            "give either --codebook FILE or --from HOST:PORT",
        ),
        (["--from", "h:1", tmp_path], "--from needs --ca (the federation's ca.pem)"),
        (["--from", "h", "--insecure", BUNDLED / "test"], "--from: expected HOST:PORT, got 'h'"),
    ):
        code, out, err = starfed(capsys, "predict", *argv)
        assert (code, out, err) == (2, "", f"starfed predict: error: {message}\n")


def test_predict_from_the_service_keeps_a_copy_and_predicts_like_the_export(
    federation, exported, tmp_path, capsys
):
    server = ServerFolder.at(tmp_path / "server")
    ensure_certificates(server, [])
    address = f"127.0.0.1:{free_port()}"
    options = ServeOptions(federation["dir"], address, server.server_cert, server.server_key)
    service, _, _ = distribution.start(options)
    images = [str(sorted((BUNDLED / "test" / name).iterdir())[0]) for name in TRAINED]
    local = starfed(capsys, "predict", "--codebook", exported, *images)
    device = ["predict", "--from", address, "--ca", server.ca_cert, "--cache", tmp_path / "cache"]
    version = wire.read_file(exported).version
    try:
        code, out, err = starfed(capsys, *device, *images)
        assert (code, out) == (0, local[1])
        assert err.startswith(f"starfed predict: codebook version {version} (full, ")
        assert (tmp_path / "cache" / CACHE_FILE).read_bytes() == exported.read_bytes()
        code, out, err = starfed(capsys, *device, *images)
        assert (code, out) == (0, local[1]) and f"version {version} (unchanged, " in err
    finally:
        service.stop(grace=None).wait()
    code, out, err = starfed(capsys, *device, *images)  # the service is gone: the copy serves
    assert (code, out) == (0, local[1])
    assert err.count("\n") == 1 and err.startswith(
        f"starfed predict: warning: cannot update the codebook ({address}: UNAVAILABLE: "
    )
    assert err.endswith(f"; using version {version} in {tmp_path / 'cache'}\n")
    code, out, err = starfed(capsys, *device[:5], "--cache", tmp_path / "empty", *images)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"starfed predict: error: {address}: UNAVAILABLE: ")
