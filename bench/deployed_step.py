"""A warm deployed step against the same step simulated with Flower, interleaved in one run.

Deployed: ``starfed server start`` and two ``starfed site start`` SuperNodes on 127.0.0.1, as
an operator runs them (tests/deployed.py does the same for the end-to-end tests); each run is
one ``starfed server run`` of ``--steps`` steps, in each of which both sites bring a task of one
class (all its bundled images: 80 training, 20 test) — several steps in one run, as a run's
evaluation travels with the next step's sync and only its last step evaluates on its own (the
run ends with a sync that finds nothing new, which carries it). Simulated: ``starfed simulate``
with Flower (SuperLink, Ray), two simulated sites, two classes per task split between them — as
many classes and images per step. One epoch everywhere. The step's seconds are the server's
own (``wall_s`` and per phase, ``phase_seconds``, in the federation's ``history.jsonl``); a
step is warm from the second on (the first loads backbones, Ray and its actors, the site
workers). Messages per step: the lines of farm-a's release record (one per message it
answered) over the steps.

(``command_s``: the whole ``starfed server run``, with the run's submission and the
ServerApp's start.) The two alternate — deployed run 1, simulation 1, deployed run 2,
simulation 2 — so the machine's load falls on both alike; the 1-minute load average is
recorded around each part.

    python bench/deployed_step.py --runs 2 --steps 3 --json /tmp/deployed-step.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from starfed.client.release_record import Release, ReleaseRecord
from starfed.shared.data.cropdiseases import bundled_dataset_root

RUN_CONFIG = {
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "replay2-epochs-per-task": 0,
}
SITES = ("farm-a", "farm-b")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def load() -> float:
    return os.getloadavg()[0]


def starfed(*argv: str, log: Path, timeout: float = 900) -> tuple[int, str]:
    with log.open("ab") as err:
        done = subprocess.run(
            [sys.executable, "-m", "starfed.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    return done.returncode, done.stdout.decode()


def add_task(site: Path, task: str, name: str) -> None:
    """Task folder ``task`` of one class with links to all its bundled images."""
    bundled = bundled_dataset_root()
    for split, target in (("train", site / task / name), ("test", site / "test" / name)):
        target.mkdir(parents=True, exist_ok=True)
        for image in sorted((bundled / split / name).iterdir()):
            (target / image.name).symlink_to(image)


def history(federation: Path) -> list[dict]:
    lines = (federation / "history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_row(record: dict) -> dict:
    phases = [
        (f"{p['phase']}/{p['round']}", round(p["seconds"], 2)) for p in record["phase_seconds"]
    ]
    return {"step": record["step"], "wall_s": round(record["wall_s"], 2), "phases": phases}


class Deployment:
    """A started server and two started sites in ``root``; ``stop`` ends them all."""

    def __init__(self, root: Path) -> None:
        self.root, self.log = root, root / "commands.log"
        self.public = f"127.0.0.1:{free_port()}"
        os.environ["STARFED_SERVER_DIR"] = str(root / "server")
        code, _ = starfed(
            "server",
            "start",
            "--insecure",
            "--listen",
            self.public,
            "--internal-port",
            str(free_port()),
            log=self.log,
        )
        if code != 0:
            raise SystemExit(f"server start failed: {self.log}")
        self.sites: dict[str, subprocess.Popen] = {}
        for name in SITES:
            with (root / f"{name}.log").open("ab") as out:
                self.sites[name] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "starfed.cli",
                        "site",
                        "start",
                        "--insecure",
                        "--server",
                        self.public,
                        "--data",
                        str(root / name),
                        "--state",
                        str(root / f"{name}-state"),
                        "--name",
                        name,
                        "--device",
                        "cpu",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )

    def run(self, steps: int) -> dict:
        """One ``server run`` until no site brings a new class (``steps`` steps); its step
        rows and the messages farm-a answered."""
        settings = [f"--run-config={k}={v}" for k, v in RUN_CONFIG.items()]
        started = time.monotonic()
        answered = len(self.answered())
        code, _ = starfed(
            "server",
            "run",
            *settings,
            "--min-sites=2",
            "--wait-s=300",
            "--timeout-s=300",
            "--json",
            log=self.log,
        )
        if code != 0:
            raise SystemExit(f"server run failed ({code}): {self.log}")
        rows = [step_row(r) for r in history(self.root / "server" / "federation")[-steps:]]
        messages = self.answered()[answered:]
        return {
            "steps": rows,
            "command_s": round(time.monotonic() - started, 2),
            "messages": len(messages),
            "messages_per_step": round(len(messages) / steps, 2),
            "message_keys": [f"{line.step + 1}:{line.phase}" for line in messages],
        }

    def answered(self) -> list[Release]:
        """The lines of farm-a's release record: a message answered (or refused) each."""
        return list(ReleaseRecord(self.root / f"{SITES[0]}-state").releases())

    def stop(self) -> None:
        for site in self.sites.values():
            if site.poll() is None:
                site.send_signal(signal.SIGINT)  # Ctrl-C: as an operator stops a site
        for site in self.sites.values():
            try:
                site.wait(60)
            except subprocess.TimeoutExpired:
                site.kill()
        starfed("server", "stop", log=self.log)


def simulate(root: Path, steps: int, index: int, runtime: str) -> list[dict]:
    """One simulation of ``steps`` steps on ``runtime``; its step rows (none when it failed: a
    Flower simulation on a loaded machine may, and the deployed rows are kept)."""
    settings = [f"--run-config={k}={v}" for k, v in RUN_CONFIG.items()]
    code, _ = starfed(
        "simulate",
        "--runtime",
        runtime,
        "--sites",
        "2",
        "--tasks",
        str(steps),
        "--classes-per-task",
        "2",
        *settings,
        "--results-dir",
        str(root / "sim"),
        "--run-name",
        f"sim-{index}",
        log=root / "simulate.log",
    )
    if code != 0:
        print(f"simulate failed ({code}): {root / 'simulate.log'}", file=sys.stderr, flush=True)
        return []
    (found,) = (root / "sim" / f"sim-{index}").rglob("history.jsonl")
    return [step_row(record) for record in history(found.parent)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="deployed runs and simulations")
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="steps per deployed run and per simulation; the warm ones are all but the first "
        "deployed step and each simulation's first",
    )
    parser.add_argument(
        "--runtime", choices=("flower", "local"), default="flower", help="the simulation's"
    )
    parser.add_argument("--root", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="deployed-step-"))
    root.mkdir(parents=True, exist_ok=True)
    for key in (
        "FLWR_TELEMETRY_ENABLED",
        "FLWR_DISABLE_UPDATE_CHECK",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION",
    ):
        os.environ[key] = "0" if key == "FLWR_TELEMETRY_ENABLED" else "1"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("FLWR_HOME", str(root / "flwr-home"))
    classes = sorted(p.name for p in (bundled_dataset_root() / "train").iterdir())
    if 2 * args.runs * args.steps > len(classes):
        raise SystemExit(f"the bundled set has {len(classes)} classes: fewer runs or steps")
    results: dict = {"deployed": [], "simulated": [], "load": []}
    deployment = Deployment(root)
    try:
        for run in range(args.runs):
            for step in range(run * args.steps, (run + 1) * args.steps):
                for i, site in enumerate(SITES):
                    add_task(root / site, f"task-{step:02d}", classes[2 * step + i])
            before = load()
            results["deployed"].append(deployment.run(args.steps))
            results["load"].append(("deployed", run, before, load()))
            print("deployed", results["deployed"][-1], flush=True)
            before = load()
            results["simulated"].append(simulate(root, args.steps, run, args.runtime))
            results["load"].append(("simulated", run, before, load()))
            print("simulated", results["simulated"][-1], flush=True)
    finally:
        deployment.stop()
    steps = [row for run in results["deployed"] for row in run["steps"]]
    deployed = [row["wall_s"] for row in steps[1:]]
    simulated = [row["wall_s"] for run in results["simulated"] for row in run[1:]]
    median = statistics.median(simulated) if simulated else math.nan
    results["summary"] = {
        "messages_per_step": [run["messages_per_step"] for run in results["deployed"]],
        "warm_deployed_s": deployed,
        "warm_simulated_s": simulated,
        "median_deployed_s": statistics.median(deployed),
        "median_simulated_s": median,
        "ratio": statistics.median(deployed) / median,
        "load_1min": [round(x, 2) for entry in results["load"] for x in entry[2:]],
    }
    print(json.dumps(results["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
