"""A started server and its sites on 127.0.0.1, for end-to-end tests of `starfed server`.

Every step is a real command: ``starfed server start --insecure`` (loopback only: TLS and node
authentication are covered by tests/test_deploy_e2e.py), one ``starfed site start`` per site,
and at the end Ctrl-C to every site, on its own terminal as a person would (``terminal``), and
``starfed server stop``. Every process started here inherits an environment marker, so the end
checks by PID (``process_sampler.marked``), independently of starfed's own bookkeeping, that
nothing is left; each site's processes also carry the site's name, so a test can kill one
site's whole machine. Tiny backbones, one epoch
everywhere, a few images per class: several minutes per round on 2 cores all the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from process_sampler import marked
from site_folders import site_folder
from terminal import Terminal

from starfed.ops.processes import ProcessId, descendants, free_port, send_signal
from starfed.server.federation import Federation
from starfed.server.ops.layout import ServerFolder
from starfed.server.ops.superlink import RunRecord
from starfed.server.records import Checkpoint

MARKER = "STARFED_ROUND_TEST"
SITE_MARKER = "STARFED_ROUND_TEST_SITE"  # which site a process belongs to
RUN_TIMEOUT_S = 480
TRAIN_IMAGES, TEST_IMAGES = 8, 3  # of each class, in a site's data folder
RUN_CONFIG = {
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "replay2-epochs-per-task": 0,
}


def starfed(*argv: str, log: Path, timeout: float = 120) -> tuple[int, str]:
    """A ``starfed`` command in its own process; (exit code, stdout); stderr to ``log``."""
    with log.open("ab") as err:
        result = subprocess.run(
            [sys.executable, "-m", "starfed.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    return result.returncode, result.stdout.decode()


def run_settings(*extra: str, timeout_s: int = 180) -> list[str]:
    """``run``/``resume`` options: one step, both sites, one epoch everywhere."""
    settings = [f"--run-config={k}={v}" for k, v in RUN_CONFIG.items()]
    return [
        *settings,
        "--steps=1",
        "--min-sites=2",
        "--wait-s=120",
        f"--timeout-s={timeout_s}",
        *extra,
    ]


@dataclass
class Deployment:
    """The server folder, the sites' address, and each site's current ``site start``."""

    root: Path
    public: str
    log: Path
    sites: dict[str, Terminal] = field(default_factory=dict)

    @property
    def server(self) -> ServerFolder:
        return ServerFolder.at(self.root / "server")

    @property
    def federation(self) -> Path:
        return self.server.federation

    def start_site(self, name: str) -> None:
        """``starfed site start`` for the data folder ``ROOT/NAME`` (state ``ROOT/NAME-state``),
        on a terminal of its own (its output in ``ROOT/NAME.log``)."""
        env = {**os.environ, SITE_MARKER: name}
        self.sites[name] = Terminal(
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
                str(self.root / name),
                "--state",
                str(self.root / f"{name}-state"),
                "--name",
                name,
                "--device",
                "cpu",
            ],
            self.root / f"{name}.log",
            env,
        )

    def join(self, name: str, tasks: dict[str, list[str]]) -> None:
        """A site that joins later: its data folder ``ROOT/NAME`` written, then ``start_site``."""
        site_folder(self.root / name, tasks, train=TRAIN_IMAGES, test=TEST_IMAGES)
        self.start_site(name)

    def stop_site(self, name: str) -> int:
        """Ctrl-C to one site's ``site start``, as its operator would; its exit code."""
        self.sites[name].ctrl_c()
        return self.sites[name].wait(60)

    def site_processes(self, name: str) -> dict[ProcessId, str]:
        """Every live process of one site (its ``site start`` and all it started)."""
        return marked(f"{SITE_MARKER}={name}", also=f"{MARKER}={self.root}")

    def serverapps(self) -> dict[ProcessId, str]:
        """The live ServerApp processes: ``flwr-serverapp`` below the server's SuperExec."""
        record = RunRecord.load(self.server.run_file)
        assert record is not None
        below = descendants(p.id for p in record.processes if p.name == "superexec")
        return {
            p: cmd
            for p, cmd in marked(f"{MARKER}={self.root}").items()
            if p in below and "flwr-serverapp" in cmd
        }

    def checkpoint(self) -> Checkpoint | None:
        """What the federation folder's ``codebook.bin`` says now (no torch)."""
        if not (self.federation / "federation.json").is_file():
            return None
        return Federation.open(self.federation).checkpoints.last_checkpoint()

    def wait_for_checkpoint(self, done: str, timeout: float) -> Checkpoint:
        """Poll the federation folder until the running step has finished phase ``done``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            checkpoint = self.checkpoint()
            if checkpoint is not None and done in checkpoint.position.to_json()["done"]:
                return checkpoint
            time.sleep(0.2)
        raise AssertionError(f"no checkpoint after {done} within {timeout:.0f}s; {self.log}")


@contextlib.contextmanager
def deployment(
    root: Path, monkeypatch: pytest.MonkeyPatch, sites: dict[str, dict[str, list[str]]]
) -> Iterator[Deployment]:
    """A started server and one started site per entry of ``sites`` (name -> its tasks); on
    leaving, Ctrl-C to every site and ``server stop``, then checks that every site stopped
    cleanly and that nothing started here is left (what is, is killed first)."""
    monkeypatch.setenv(MARKER, str(root))  # every process started here inherits it
    monkeypatch.setenv("STARFED_SERVER_DIR", str(root / "server"))
    for name, tasks in sites.items():
        site_folder(root / name, tasks, train=TRAIN_IMAGES, test=TEST_IMAGES)
    deployed = Deployment(root, f"127.0.0.1:{free_port()}", root / "commands.log")
    try:
        code, _ = starfed(
            "server",
            "start",
            "--insecure",
            "--listen",
            deployed.public,
            "--internal-port",
            str(free_port()),
            log=deployed.log,
        )
        assert code == 0, deployed.log.read_text()
        for name in sites:
            deployed.start_site(name)
        yield deployed
    finally:
        for site in deployed.sites.values():
            if site.poll() is None:
                site.ctrl_c()  # the site's SuperNode goes offline
        for site in deployed.sites.values():
            try:
                site.wait(60)
            except subprocess.TimeoutExpired:
                site.kill()
        code, out = starfed("server", "stop", "--json", log=deployed.log)
        time.sleep(1)
        left = marked(f"{MARKER}={root}")
        send_signal(left, signal.SIGKILL)  # never leak into the rest of the session
    assert code == 0 and json.loads(out)["survivors"] == [], out
    assert {name: site.poll() for name, site in deployed.sites.items()} == dict.fromkeys(
        deployed.sites, 0
    )
    said = {name: site.text() for name, site in deployed.sites.items()}
    assert not [name for name, text in said.items() if "Traceback" in text], said
    assert left == {}, f"processes left running: {left}"
