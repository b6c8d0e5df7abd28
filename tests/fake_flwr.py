"""A stand-in for Flower 1.42's ``flwr`` CLI, for tests of what starfed does with its answers.

It answers like Flower: ``--format json`` errors with exit code 0, runs that go through the
statuses of ``state.json`` (one per ``ls``; the last one stays), ``stop``, ``supernode
register|list|unregister``, ``log`` printing the ServerApp's progress. Like Flower it reads a
folder named like the connection, with a ``pyproject.toml``, in its working folder as an app of
legacy usage ("Heads up from Flower!", exit 1; flwr/cli/config_migration.py). Every call is
logged to ``calls.jsonl`` with its arguments and working folder.

Two statuses act: ``"gone"`` kills the process ``state["superlink"]`` names and answers as
Flower does once the SuperLink is unreachable (``log`` too, from then on: ``state["killed"]``);
a run-config ``federation-dir`` gets ``state["metrics"]`` as its ``metrics.json`` when the run
is submitted (the ServerApp's result). With ``state["streaming"]``, ``log`` streams, as Flower's
does, until the run has finished: until a file ``finished`` appears beside the state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from starfed.ops import flower_runs, processes

UNAVAILABLE = (
    "Connection to the SuperLink is unavailable. Please check your network connection and "
    "'address' in the SuperLink connection configuration."
)

SCRIPT = """\
import json, os, signal, sys, time
from pathlib import Path
here = Path(__file__).parent
args = sys.argv[1:]
with (here / "calls.jsonl").open("a") as log:
    log.write(json.dumps({"argv": args, "cwd": os.getcwd()}) + "\\n")
state = json.loads((here / "state.json").read_text())
def save():  # atomically: `log` reads it while `ls` writes it
    (here / "state.tmp").write_text(json.dumps(state))
    os.replace(here / "state.tmp", here / "state.json")
if "starfed" in args and Path("starfed", "pyproject.toml").exists():
    print("Heads up from Flower! We detected legacy usage of this command ...")
    sys.exit(1)
def answer(**fields):
    print(json.dumps({"success": True, **fields}))
action = args[0]
if action == "log":
    print("ServerApp: step 1 ...", flush=True)
    while state.get("streaming") and not (here / "finished").exists():
        time.sleep(0.05)  # Flower ends the stream once the run has finished
    if state.get("killed"):  # only once `ls` killed it: before, it still answered (a race)
        print("Error: " + UNAVAILABLE, file=sys.stderr)
        sys.exit(1)
elif action == "run" and state.get("refuse"):
    print(json.dumps({"success": False, "error-message": "Using SuperLink: x\\n[code: 7] no"}))
elif action == "run":
    print("notice line first")
    for value in args:
        if value.startswith("federation-dir=") and "metrics" in state:
            folder = Path(json.loads(value.split("=", 1)[1]))
            (folder / "metrics.json").write_text(json.dumps(state["metrics"]))
    answer(**{"run-id": "42"})
elif action == "ls":
    statuses = state["statuses"]
    status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
    save()
    if status == "gone":
        os.kill(state["superlink"], signal.SIGKILL)
        state["killed"] = True
        save()
        print(json.dumps({"success": False, "error-message": UNAVAILABLE}))
    else:
        answer(runs=[{"run-id": "42", "status": status}])
elif action == "stop":
    state["statuses"] = ["finished:stopped"]
    save()
    answer()
elif args[:2] == ["supernode", "register"]:
    answer(**{"node-id": 42})
elif args[:2] == ["supernode", "list"]:
    answer(nodes=state.get("nodes", []))
elif args[:2] == ["supernode", "unregister"]:
    answer()
"""


def install(bin_dir: Path, monkeypatch: pytest.MonkeyPatch, **state: object) -> Path:
    """The fake as the ``flwr`` starfed runs, with ``state`` (default: one run, running);
    returns ``bin_dir``, where its ``state.json`` and ``calls.jsonl`` are."""
    bin_dir.mkdir(parents=True)
    (bin_dir / "flwr.py").write_text(f"UNAVAILABLE = {UNAVAILABLE!r}\n" + SCRIPT)
    set_state(bin_dir, **{"statuses": ["running"], **state})
    script = bin_dir / "flwr"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {bin_dir / "flwr.py"} "$@"\n')
    script.chmod(0o755)
    monkeypatch.setattr(processes, "flower_executable", lambda name: str(script))
    monkeypatch.setattr(flower_runs, "POLL_S", 0.01)
    return bin_dir


def set_state(bin_dir: Path, **state: object) -> None:
    (bin_dir / "state.json").write_text(json.dumps(state))


def calls(bin_dir: Path) -> list[dict]:
    """Every call so far: ``{"argv": [...], "cwd": "..."}``."""
    path = bin_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkout(folder: Path) -> Path:
    """``folder`` holding a ``starfed/`` checkout, as the README's ``git clone`` leaves it."""
    (folder / "starfed").mkdir(parents=True)
    (folder / "starfed" / "pyproject.toml").write_text('[project]\nname = "starfed"\n')
    return folder
