"""The local runtime: the real ServerApp logic and the real ClientApp, in this process.

`flwr run` costs a SuperLink, a SuperExec and Ray (about a minute on two cores) before any
training starts. ``LocalGrid`` is a Flower ``Grid`` that instead hands each message straight to
the ClientApp (``starfed.client.app:app``), node after node, as Flower's runtime would: with a
``Context`` per node and an error reply for an exception. ``run_locally`` drives it as the
Flower runtime's simulation ServerApp (``starfed.simulations.server_app``) drives Flower's grid
— ``run_server``, with the simulated sites' folders written before each step — so a run
computes what the Flower runtime computes (``tests/test_local_runtime.py`` checks it).
``starfed simulate --runtime local`` and the experiment harness (``starfed experiment``) use it;
the protocol tests use its ``faults`` (make a node silent, raise, or tamper with its replies)
and ``record`` (keep what was sent).
"""

from __future__ import annotations

import logging
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from starfed.client import site
from starfed.client.app import app as client_app
from starfed.ops.exit_codes import EXIT_FAILED, run_exit_code
from starfed.ops.flower_internals import SUPERLINK_NODE_ID, TaskIdentity
from starfed.ops.flower_runs import summarize
from starfed.server.app import RunFailed, run_server
from starfed.server.strategy import Strategy
from starfed.shared import progress, thread_pools
from starfed.shared.codebook.codebook import Codebook, Delta
from starfed.shared.codebook.wire import decode_broadcast
from starfed.shared.config import parse
from starfed.shared.knob import Value, as_int
from starfed.shared.metrics import results_line
from starfed.shared.protocol import (
    CATCH_UP_KEY,
    CATCH_UP_MESSAGE,
    CODEBOOK_RECORD,
    MESSAGES,
    RECORD_DATA,
    STEP,
    record_bytes,
    record_int,
)
from starfed.simulations.simulate import CLIENT_CPUS
from starfed.simulations.simulated_sites import SimulatedSites

Fault = Callable[[Message], Message | None]  # gets the reply; None = the node stays silent
#: Flower message type -> the key its progress bar shows (a phase's, or the catch-up's)
PHASE_KEYS = {spec.message_type: spec.phase.key for spec in MESSAGES} | {
    CATCH_UP_MESSAGE: CATCH_UP_KEY
}


@dataclass
class LocalGrid:
    """A Flower ``Grid`` whose nodes are (ClientApp, node config) pairs called in order."""

    app: ClientApp
    run_config: dict
    node_configs: dict[int, dict]
    run_id: int = 1
    faults: dict[tuple[int, str], Fault] = field(default_factory=dict)
    record: bool = False  # keep every message sent in ``sent`` (tests read the broadcasts)
    progress: Progress | None = None  # a bar per phase: which node is answering
    # threads of a ClientApp call: what a Flower-simulated client has, so that float rounding,
    # and with it every number of a run, equals the Flower runtime's
    client_threads: int = CLIENT_CPUS
    sent: list[Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Flower's runtime sets the identity of the ServerApp process; messages need it.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = self.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_configs)

    def codebooks_sent(self) -> dict[str, Codebook]:
        """The codebook each recorded message carried, keyed by message id: deltas are applied
        to what the same node was sent before, as the site does."""
        stored: dict[int, Codebook] = {}  # each node's codebook, as its site holds it
        out = {}
        for message in self.sent:
            if CODEBOOK_RECORD not in message.content:
                continue
            node = message.metadata.dst_node_id
            received = decode_broadcast(
                record_bytes(message.content[CODEBOOK_RECORD][RECORD_DATA], CODEBOOK_RECORD)
            )
            if isinstance(received, Delta):
                received = stored[node].apply(received)
            stored[node] = out[message.metadata.message_id] = received
        return out

    def _context(self, node_id: int) -> Context:
        return Context(
            run_id=self.run_id,
            node_id=node_id,
            node_config=self.node_configs[node_id],
            state=RecordDict(),
            run_config=self.run_config,
        )

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Every message to its node in turn; the replies, as Flower's grid returns them.

        Nodes run one after another in this thread, so ``timeout`` bounds nothing; it is still
        required, as every send of the server must have one.
        """
        if timeout is None:
            raise ValueError("every send needs a timeout")
        messages = list(messages)
        replies = []
        with _PhaseBar(self.progress, messages) as advance:
            for message in messages:
                reply = self._deliver(message)
                if reply is not None:
                    replies.append(reply)
                advance()
        return replies

    def _deliver(self, message: Message) -> Message | None:
        # Flower's grids give a message its id when they push it (InMemoryGrid does the same).
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        if self.record:
            self.sent.append(message)
        else:
            self.sent = [message]  # the one being answered (faults may look at it)
        node = message.metadata.dst_node_id
        try:
            with _threads(self.client_threads):
                reply = self.app(message, self._context(node))
        except Exception as err:  # the runtime reports client failures as error replies
            reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
        reply.metadata.__dict__["_src_node_id"] = node
        fault = self.faults.get((node, message.metadata.message_type))
        return reply if fault is None else fault(reply)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Every thread pool at ``n`` threads — torch's, and the OpenMP and BLAS pools scikit-learn
    and numpy use — as Ray's ``OMP_NUM_THREADS`` does for a simulated client; the server's work
    keeps the process's threads. Besides equal rounding, this spares a loaded machine OpenMP
    threads that spin waiting for each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with thread_pools.controller().limit(limits=n):
            yield
    finally:
        torch.set_num_threads(before)


class _PhaseBar:
    """One progress bar for one phase's messages ("step 3 · stage2 · 2/5 sites")."""

    def __init__(self, progress: Progress | None, messages: list[Message]) -> None:
        self.bar: tuple[Progress, TaskID] | None = None
        if progress is not None and messages:
            first = messages[0]
            step = record_int(first.content["config"][STEP], STEP) + 1
            phase = PHASE_KEYS.get(first.metadata.message_type, first.metadata.message_type)
            self.bar = progress, progress.add_task(f"step {step} · {phase}", total=len(messages))

    def __enter__(self) -> Callable[[], None]:
        if self.bar is None:
            return lambda: None
        bars, task = self.bar
        return lambda: bars.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            bars, task = self.bar
            bars.remove_task(task)


# --- a whole simulation ----------------------------------------------------------------------


def new_run_id() -> int:
    """A random run id, as Flower's: the ClientApp keeps its sites per (run, node)."""
    return random.SystemRandom().getrandbits(63)


def node_configs(n_sites: int) -> dict[int, dict]:
    """What Flower's simulation gives each SuperNode: its partition and the partition count."""
    return {p + 1: {"partition-id": p, "num-partitions": n_sites} for p in range(n_sites)}


def run_locally(
    run_config: Mapping[str, object],
    console: Console | None = None,
    *,
    strategy: Strategy | None = None,
) -> dict:
    """One simulation on the local runtime: ``run_server`` over a ``LocalGrid`` of
    ``num-sites`` simulated sites, with ``strategy`` (starfed's by default), their data
    folders written before each step (``SimulatedSites``); the metrics it wrote to
    ``metrics.json``.

    A failed run raises ``RunFailed`` after writing its metrics, as the ServerApp does.
    """
    console = console or progress.console(stderr=True)
    config = dict(run_config)
    n_sites = int(parse(config)["num-sites"])
    run_id = new_run_id()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("sites"),
        TimeElapsedColumn(),
    )
    with (
        Progress(*columns, console=console, transient=True) as bars,
        progress.logged_to(console),
        _sites_quiet(),
    ):
        grid = LocalGrid(client_app, config, node_configs(n_sites), run_id, progress=bars)
        sites = SimulatedSites.of(config, run_id)
        return run_server(grid, config, run_id, strategy=strategy, before_step=sites)


@contextmanager
def _sites_quiet() -> Iterator[None]:
    """A deployed site's terminal lines (``client.site``: one per phase) stay off this one,
    where every simulated site would print them; its warnings still show."""
    site_lines = logging.getLogger(site.__name__)
    level = site_lines.level
    site_lines.setLevel(logging.WARNING)
    try:
        yield
    finally:
        site_lines.setLevel(level)


def simulate_locally(overrides: Mapping[str, Value]) -> int:
    """`starfed simulate --runtime local`: the run's exit code (``exit_codes.RUN_EXIT_CODES``:
    0 completed, 3 degraded, 1 failed), as with the Flower runtime."""
    run_dir = Path(str(overrides["results-dir"])) / str(overrides["run-name"])
    sites = progress.counted(as_int(overrides, "num-sites"), "simulated site")
    print(f"local runtime: {sites} in this process, results in {run_dir}")
    started = time.monotonic()
    try:
        metrics = run_locally(overrides)
    except RunFailed as err:
        print(
            f"error: the run failed after {time.monotonic() - started:.0f}s: {err}", file=sys.stderr
        )
        return EXIT_FAILED
    print(f"finished in {time.monotonic() - started:.0f}s · {summarize(metrics)}")
    print(results_line(run_dir))
    return run_exit_code(metrics.get("status"))
