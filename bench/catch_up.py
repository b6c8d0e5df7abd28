"""A site joining late: the catch-up's traffic and time at the paper's dims (issue 34, part 1).

For a federation of C paper-dims classes (random tensors: float bytes do not compress), what a
site that holds nothing receives before its first phase: the codebook in parts of at most
``part-bytes``, its default (``starfed.server.catch_up``). Measured without Flower (the wire is
a folder), each end in a fresh process so that its peak RSS is its own: the server (holding the
codebook) decides who is behind, plans and encodes every part, one at a time; the site stages
each part as it arrives (decoded, written) and after the last writes the held file from the
parts and decodes it. Bytes and messages are what the wire would carry, the phase message's
empty delta left out.

``--slow-site S`` measures instead what one slow site costs the others (issue 43, attack 7):
the send and collect of one phase (``catch_up.before_phase``, the phase's message, the streams
that ended meanwhile: what ``Coordinator._send_phase`` does) over a grid of two sites, one that
holds the codebook and answers the phase in 0.1 s, one joining that reads each of ``--parts``
parts (paper-dims classes) in S seconds, the grid pushing and pulling as Flower's does (its
sites in threads of their own). ``--inline`` gives the same grid without pushes and pulls: every
catch-up runs to its end before the phase, as every catch-up did before the streams.

    python bench/catch_up.py                        # 100, 1000, 10000 classes, float32
    python bench/catch_up.py --classes 100 1000 --dtype float16
    python bench/catch_up.py --slow-site 1 --parts 6 [--inline]
    python bench/catch_up.py --resume --classes 1000 3000

``--resume``: a site that staged every part but the last when its catch-up stopped at a step's
end, caught up a step later, when that step's replay had realigned every class's head: what
the resumed catch-up sends (the changes of the staged parts, then the last part), against the
whole codebook.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from codebook_sizes import PAPER
from flwr.app import ConfigRecord, Message, RecordDict

from starfed.ops.flower_internals import SUPERLINK_NODE_ID, TaskIdentity
from starfed.server import catch_up
from starfed.server.messaging import exchange, message_config
from starfed.server.participants import Participants
from starfed.shared.codebook import parts, schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.config import ProtocolOptions
from starfed.shared.protocol import (
    CATCH_UP,
    HELD,
    RECORD_DATA,
    STAGED,
)

FINGERPRINT = "ab" * 32
PART_BYTES = ProtocolOptions().part_bytes  # the run config's part-bytes, by default
LINE = Lineage("bench", "epoch-1")


def federation(n_classes: int) -> Codebook:
    """A codebook of ``n_classes`` paper-dims classes with every field sites read."""
    generator = torch.Generator().manual_seed(0)
    entries = [
        ClassEntry(
            f"class_{i:05d}",
            100,
            {
                f.name: torch.randn(f.shape(PAPER), generator=generator)
                for f in schema.FIELDS
                if f.broadcast
            },
        )
        for i in range(n_classes)
    ]
    return Codebook(FINGERPRINT, PAPER, {}, 0, LINE.as_metadata()).register(entries)


def server(n_classes: int, dtype: str, folder: Path) -> dict[str, object]:
    """The server's side: who is behind, the plan, every part encoded (and written to
    ``folder`` for the site's side, outside the timing)."""
    codebook = federation(n_classes)
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    late = catch_up.behind(codebook, {}, [1], dtype, PART_BYTES)
    plan = parts.plan(codebook, PART_BYTES, dtype)
    encode_s, sent = time.perf_counter() - t0, 0
    for index in range(len(plan.parts)):
        t0 = time.perf_counter()
        data = plan.encoded(index)
        encode_s += time.perf_counter() - t0
        sent += len(data)
        (folder / f"{index}.bin").write_bytes(data)
        del data
    manifest = {"dtype": dtype, "keys": plan.keys, "changed": plan.changed}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return {
        "classes": n_classes,
        "dtype": dtype,
        "behind": late == [1],
        "messages": len(plan.parts),
        "bytes": sent,
        "part_limit": PART_BYTES,
        "server_encode_s": round(encode_s, 2),
        "server_peak_rss_mb": _rss_mb(),
        "server_codebook_rss_mb": rss_before,
    }


def site(n_classes: int, messages: int, folder: Path) -> dict[str, object]:
    """The site's side: each part staged as it arrives, then the codebook held."""
    baseline = _rss_mb()
    stored = HeldCodebook(folder / "state" / "codebook.bin", fingerprint=FINGERPRINT, dims=PAPER)
    stage_s = 0.0
    sent = json.loads((folder / "manifest.json").read_text())
    keys, changed = tuple(sent["keys"]), tuple(sent["changed"])
    for index in range(messages):
        data = (folder / f"{index}.bin").read_bytes()
        manifest = (keys, changed) if index == 0 else ((), ())
        label = parts.Label(index, messages, n_classes, *manifest)
        t0 = time.perf_counter()
        stored.stage(data, label, 0, sent["dtype"])
        stage_s += time.perf_counter() - t0
        del data
    assert stored.version_for(LINE) == 1 and len(stored.codebook() or ()) == n_classes
    return {
        "site_stage_and_hold_s": round(stage_s, 2),
        "site_peak_rss_mb": _rss_mb(),
        "site_baseline_rss_mb": baseline,
    }


# --- one slow site (--slow-site) ---------------------------------------------------------------

PHASE_S = 0.1  # the honest site's answer to the phase
PHASE_MESSAGE = "train.stage1"


class TwoSites:
    """A grid of two sites answering in threads of their own, as SuperNodes do: node 1 answers
    a phase in ``PHASE_S``, node 2 each catch-up part in ``part_s`` (its last reply: the version
    it holds). This one has no pushes and pulls: a send waits for every reply."""

    def __init__(self, part_s: float, version: int) -> None:
        self.part_s, self.version = part_s, version
        self.workers = {node: ThreadPoolExecutor(1) for node in (1, 2)}
        self.replies: dict[str, Future[Message]] = {}

    def get_node_ids(self) -> list[int]:
        return [1, 2]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return [self.replies.pop(i).result() for i in self._submit(messages)]

    def _submit(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            ids.append(uuid.uuid4().hex)
            message.metadata.__dict__["_message_id"] = ids[-1]
            worker = self.workers[message.metadata.dst_node_id]
            self.replies[ids[-1]] = worker.submit(self._answer, message)
        return ids

    def _answer(self, message: Message) -> Message:
        config = message.content["config"]
        if CATCH_UP not in config:
            time.sleep(PHASE_S)
            return Message(RecordDict(), reply_to=message)
        time.sleep(self.part_s)
        index, count, _ = config[CATCH_UP]
        version = str(self.version if index == count - 1 else 0).encode()
        return Message(RecordDict({HELD: ConfigRecord({RECORD_DATA: version})}), reply_to=message)


class Pushing(TwoSites):
    """The same sites on a grid that pushes and pulls, as Flower's does."""

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        return self._submit(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        done = [i for i in message_ids if self.replies[i].done()]
        return [self.replies.pop(i).result() for i in done]


def slow_site(part_s: float, n_parts: int, inline: bool) -> dict[str, object]:
    """One phase's send and collect with node 2 joining: its wall, and node 1's reply time."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        setattr(TaskIdentity, name, value)  # what a ServerApp's process has
    codebook = federation(n_parts)
    one = replace(codebook, entries={codebook.names[0]: codebook[codebook.names[0]]})
    part_bytes = parts.broadcast_bytes(one, 0, "float32") * 3 // 2
    grid = (TwoSites if inline else Pushing)(part_s, codebook.version)
    participants = Participants(node_ids=[1, 2], versions={1: codebook.version})
    sites, ledger = {1: "farm-a", 2: "farm-b"}, catch_up.Ledger()
    config = message_config(0, 0, codebook, "float32")
    t0 = time.perf_counter()
    caught = catch_up.before_phase(
        grid, codebook, participants, [1, 2], 0, "float32", part_bytes, sites, 600, ledger
    )
    good, _ = exchange(grid, PHASE_MESSAGE, "stage1", 0, 0, config, caught.nodes, sites, None, 600)
    joined = catch_up.joined(ledger, participants, codebook.version)
    wall = time.perf_counter() - t0
    for stream in ledger.streams.values():
        stream.stop.set()
    return {
        "grid": "answers at once (before)" if inline else "pushes and pulls (streams)",
        "parts": n_parts,
        "part_s": part_s,
        "phase_wall_s": round(wall, 2),
        "phase_nodes": caught.nodes + joined.nodes,
        "caught_up_in_phase": 2 in caught.nodes + joined.nodes,
        "answers": len(good),
        "threads": threading.active_count(),
    }


# --- a catch-up resumed a step later (--resume) ------------------------------------------------


class StagingSite:
    """One site (node 1) staging its catch-up parts in ``folder`` as a site does
    (``HeldCodebook.stage``), its reply as ``client.answer``'s (``HELD``, ``STAGED``); the
    seconds it spent staging."""

    def __init__(self, folder: Path) -> None:
        self.stored = HeldCodebook(folder / "codebook.bin", fingerprint=FINGERPRINT, dims=PAPER)
        self.seconds = 0.0

    def get_node_ids(self) -> list[int]:
        return [1]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        return [self._answer(message) for message in messages]

    def _answer(self, message: Message) -> Message:
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as a grid's push does
        config, data = message.content["config"], message.content["codebook"]["data"]
        label = parts.Label.of(config)
        t0 = time.perf_counter()
        self.stored.stage(data, label, config["step"], config["wire-dtype"])
        self.seconds += time.perf_counter() - t0
        records = {
            HELD: str(self.stored.version_for(LINE)).encode(),
            STAGED: self.stored.staged_parts(),
        }
        content = RecordDict({k: ConfigRecord({RECORD_DATA: v}) for k, v in records.items()})
        return Message(content, reply_to=message)


def resume(n_classes: int, dtype: str) -> dict[str, object]:
    """A site that staged every part but the last of a codebook of ``n_classes`` when its
    catch-up stopped (the step's end), caught up a step later, when the step's replay had
    realigned every class's head (``aligned_head_*``): what the resumed catch-up sends, in how
    many messages, against the whole codebook; the site's seconds to stage it and hold the
    codebook."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID)):
        setattr(TaskIdentity, name, value)  # what a ServerApp's process has
    codebook = federation(n_classes)
    first = parts.plan(codebook, PART_BYTES, dtype)
    generator = torch.Generator().manual_seed(1)
    realigned = codebook.set_values(
        {
            name: {
                "aligned_head_weight": torch.randn(PAPER.d_vit, generator=generator),
                "aligned_head_bias": torch.randn((), generator=generator),
            }
            for name in codebook.names
        }
    )
    count = len(first.parts)
    if count < 2:
        raise SystemExit(f"{n_classes} classes are one part: nothing to resume")
    with tempfile.TemporaryDirectory() as tmp:
        site = StagingSite(Path(tmp))
        for index in range(count - 1):  # the first step: all but the last part
            manifest = (first.keys, first.changed) if index == 0 else ()
            label = parts.Label(index, count, n_classes, *manifest)
            site.stored.stage(first.encoded(index), label, 0, dtype)
        site.seconds = 0.0
        said = struct.unpack(f"<{count}Q", site.stored.staged_parts())  # its last reply
        known = {key: version for key, version in zip(first.keys, said, strict=True) if version}
        stream = catch_up.Stream(realigned.version, known)
        sites = {1: "farm-b"}
        t0 = time.perf_counter()
        caught = catch_up.send(site, realigned, 1, 1, dtype, PART_BYTES, sites, 600, stream)
        wall = time.perf_counter() - t0
        assert caught and len(site.stored.codebook() or ()) == n_classes
    resumed = sum(e.bytes_down for e in stream.exchanges)
    whole = parts.broadcast_bytes(realigned, 0, dtype)
    return {
        "classes": n_classes,
        "dtype": dtype,
        "parts": count,
        "whole_bytes_bound": whole,
        "resumed_messages": len(stream.exchanges),
        "resumed_bytes": resumed,
        "last_part_bytes": len(parts.plan(realigned, PART_BYTES, dtype).encoded(count - 1)),
        "resume_wall_s": round(wall, 2),
        "site_stage_and_hold_s": round(site.seconds, 2),
    }


def _rss_mb() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _side(*argv: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--slow-site", type=float, metavar="S", help="seconds a part, one site")
    parser.add_argument("--parts", type=int, default=6)
    parser.add_argument("--inline", action="store_true", help="a grid without pushes and pulls")
    parser.add_argument("--resume", action="store_true", help="a catch-up resumed a step later")
    parser.add_argument("--side", choices=["server", "site"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        for n in args.classes:
            print(json.dumps(resume(n, args.dtype)), flush=True)
        _machine()
        return
    if args.slow_site is not None:
        print(json.dumps(slow_site(args.slow_site, args.parts, args.inline)))
        _machine()
        return
    if args.side == "server":
        print(json.dumps(server(args.classes[0], args.dtype, args.folder)))
        return
    if args.side == "site":
        print(json.dumps(site(args.classes[0], args.messages, args.folder)))
        return
    for n in args.classes:
        with tempfile.TemporaryDirectory() as tmp:
            row = _side(
                "--side", "server", "--classes", str(n), "--dtype", args.dtype, "--folder", tmp
            )
            row |= _side(
                "--side",
                "site",
                "--classes",
                str(n),
                "--messages",
                str(row["messages"]),
                "--folder",
                tmp,
            )
        print(json.dumps(row), flush=True)
    _machine()


def _machine() -> None:
    load = os.getloadavg()[0]
    print(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "load_1min": load}))


if __name__ == "__main__":
    main()
