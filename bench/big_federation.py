"""A federation of N paper-dims classes: what each view of it costs, and what a step writes.

Builds a synthetic federation folder (one completed step registered N random classes at the
paper's dims, float32 tensors, 5-component float64 mixtures) and measures, each in a fresh
process where a user would start one:

* ``starfed server status --json``, ``check``, ``check --deep``, ``repair --dry-run``: wall and
  own CPU time, with the 1-minute load (the machine may be shared);
* the dashboard's ``/api/state`` (``status.read`` + ``dashboard_state.build_state``, as the
  handler);
* ``starfed server export`` and loading the exported codebook as ``predict`` does
  (``wire.read_file`` + the class bank);
* the throughput of each stdlib hash over the largest store file (``--views hashes``);
* one synthetic step in process, checkpointed phase by phase as the coordinator does (4 new
  classes trained, their mixtures fitted, every class's aligned head re-aligned, the classes
  frozen): the bytes it wrote (``/proc/self/io`` wchar) against the encoded size of what it
  changed, and the step's wall and peak RSS.

    python bench/big_federation.py --classes 100 1000 10000 --out bench/results/big-federation.json

``--views`` picks what to measure; ``--keep DIR`` builds each federation once in ``DIR/<N>`` and
keeps it for later runs (the step then runs on a copy).

The base is written in chunks of classes (a protobuf message's repeated field concatenates), so
building 10,000 classes (about 2 GB) never holds the codebook's bytes twice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from codebooks import changed_fields, full_entry  # no pytest: tests/codebooks.py says why

from starfed.server.federation import Federation
from starfed.server.folder_files import HISTORY_FILE
from starfed.server.records import Position, StepRecord
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.framing import CODEBOOK_MAGIC, frame
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import TENSORS, ModelDims
from starfed.shared.files import write_atomic
from starfed.shared.run_status import COMPLETED

PAPER_DIMS = ModelDims(d_txt=768, d_clip=768, d_vit=768, n_layers=12)
FINGERPRINT = "be" * 32
CHUNK = 250  # classes encoded at a time
COMPARE_UP_TO = 1000  # the layout before writes ~16 codebooks a step: 32 GB at 10,000 classes


def build(
    root: Path,
    n: int,
    before: bool = False,
    fingerprint: str = FINGERPRINT,
    dims: ModelDims = PAPER_DIMS,
) -> Path:
    """``root/server/federation`` after one completed step that registered ``n`` classes;
    ``before``: in the layout before the store (``codebook.bin`` a whole codebook file);
    ``fingerprint`` and ``dims``: of the backbones that will open it (``bench/big_step.py``)."""
    from starfed.shared.codebook import store_io, store_layout  # not in a checkout before the store

    folder = root / "server" / "federation"
    federation = Federation(folder, fingerprint, dims)
    names = [f"class {i:05d}" for i in range(n)]
    lineage = Federation.open(folder).checkpoints.codebook().metadata
    metadata = {**lineage, **Position(1).as_metadata()}
    head = Codebook(fingerprint, dims, version=1, metadata=metadata)
    (folder / store_layout.STORE_DIR).mkdir()
    base = store_io.new_name(1)
    generator = torch.Generator().manual_seed(n)
    lines = []
    with open(folder / store_layout.STORE_DIR / base, "wb") as file:
        file.write(b"\0" * 48)  # the frame's header, written last
        digest, length = hashlib.sha256(), 0
        for start in range(0, n, CHUNK):
            chunk = [
                full_entry(name, dims, generator, version=1)
                for name in names[start : start + CHUNK]
            ]
            part = wire.encode(replace(head, entries={e.name: e for e in chunk}))
            digest.update(part)
            length += len(part)
            file.write(part)
            lines += [replace(e, values={}, field_versions={}) for e in chunk]
        file.seek(0)
        file.write(CODEBOOK_MAGIC + length.to_bytes(8, "little") + digest.digest())
    manifest = store_layout.header(wire.to_proto(replace(head, entries={e.name: e for e in lines})))
    ref = store_layout.Ref(base, base.replace("base-", "log-", 1))
    manifest.metadata.update(ref.as_metadata())
    write_atomic(folder / "codebook.bin", frame(manifest.SerializeToString(deterministic=True)))
    if before:
        os.replace(folder / store_layout.STORE_DIR / base, folder / "codebook.bin")
        (folder / store_layout.STORE_DIR).rmdir()
    federation.register(names, 0, {name: ["site-a"] for name in names})
    record = StepRecord(0, COMPLETED, time.time(), 1.0, classes=tuple(names), codebook_version=1)
    (folder / HISTORY_FILE).write_text(record.to_json() + "\n")
    return folder


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], timeout: float, env: dict | None = None) -> dict:
    """A command's wall, its own CPU time (user + system: what the machine's other load does
    not change much) and exit code (a fresh process, as a user runs it), with the 1-minute
    load when it started."""
    load, cpu, started = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout, text=True, env=env)
        code = done.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(_children_cpu() - cpu, 2),
        "exit": code,
        "load": round(load, 1),
    }


def python(code: str, timeout: float, env: dict | None = None) -> dict:
    """``code`` in a fresh interpreter: as ``timed``, with the line it prints (JSON)."""
    load, cpu, started = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=timeout, text=True, env=env
        )
    except subprocess.TimeoutExpired:
        return {"wall_s": timeout, "exit": "timeout"}
    out = (
        json.loads(done.stdout.splitlines()[-1])
        if done.returncode == 0
        else {"error": done.stderr.strip().splitlines()[-1:]}
    )
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(_children_cpu() - cpu, 2),
        "exit": done.returncode,
        "load": round(load, 1),
        **out,
    }


API_STATE = """
import json, time
from pathlib import Path
from starfed.server.ops import dashboard_state, status
from starfed.server.ops.layout import ServerFolder
t = time.perf_counter()
folder = ServerFolder.at({server!r})
state = dashboard_state.build_state(status.read(folder, folder.federation), folder, [], [])
body = json.dumps(state.to_json())
print(json.dumps({{"in_process_s": round(time.perf_counter() - t, 2), "bytes": len(body)}}))
"""

IN_PROCESS = """
import json, resource, time
from starfed.server import folder_check
from starfed.server.ops import status
from starfed.server.ops.layout import ServerFolder
folder = ServerFolder.at({server!r})
t = time.perf_counter()
status.read(folder, folder.federation)
s = time.perf_counter() - t
t = time.perf_counter()
report = folder_check.check(folder.federation)
print(json.dumps({{"status_s": round(s, 2), "check_s": round(time.perf_counter() - t, 2),
    "check_ok": report.ok,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}}))
"""

PREDICT_LOAD = """
import json, resource, time
from starfed.shared.codebook import wire
t = time.perf_counter()
codebook = wire.read_file({path!r})
bank = codebook.bank()
print(json.dumps({{"load_s": round(time.perf_counter() - t, 2), "classes": len(codebook),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}}))
"""


def wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def synthetic_step(folder: Path, new: int = 4) -> dict:
    """One step checkpointed phase by phase as the coordinator does, with random values."""
    generator = torch.Generator().manual_seed(34)
    federation = Federation.open(folder)
    started = time.perf_counter()
    codebook = federation.checkpoints.codebook()
    loaded_s = time.perf_counter() - started
    step, start = 1, codebook
    written, t0 = wchar(), time.perf_counter()
    names = [f"new {i}" for i in range(new)]
    federation.register(names, step, {})
    federation.begin_step(start)
    fresh = [replace(full_entry(n, PAPER_DIMS, generator), frozen=False) for n in names]
    untrained = [
        replace(e, values={f: v for f, v in e.values.items() if f in TENSORS}) for e in fresh
    ]
    codebook = codebook.register(untrained)
    done: tuple[str, ...] = ()

    def phase(mark: str, values: dict) -> None:
        nonlocal codebook, done
        codebook = codebook.set_values(values) if values else codebook
        done = (*done, mark)
        position = Position(step, running=True, done=done, in_play=tuple(names))
        codebook = federation.checkpoint(codebook, position)

    def fresh_values(fields: tuple[str, ...], classes: list[str]) -> dict:
        by_name = {e.name: e for e in fresh}
        return {n: {f: _other(by_name[n].values[f], generator) for f in fields} for n in classes}

    phase("sync/0", {})
    phase("stage1/0", fresh_values(("prompt",), names))
    phase("stage1_stats/0", fresh_values(("clip_mixture",), names))
    phase("stage1/1", fresh_values(("prompt", "key"), names))  # the first-level replay
    phase(
        "stage2/0",
        fresh_values(("query_prompt", "query_weight", "head_weight", "head_bias"), names),
    )
    phase("stage2_stats/0", fresh_values(("vit_mixture",), names))
    heads = {
        n: {
            "aligned_head_weight": torch.randn(PAPER_DIMS.d_vit, generator=generator),
            "aligned_head_bias": torch.randn((), generator=generator),
        }
        for n in codebook.names
    }
    codebook = codebook.set_values(heads, freeze=names)
    record = StepRecord(
        step, COMPLETED, time.time(), 1.0, classes=tuple(names), codebook_version=codebook.version
    )
    federation.end_step(record, codebook, keep_steps=10)
    step_written = wchar() - written
    changed = len(wire.encode(changed_fields(start, codebook)))
    return {
        "load_s": round(loaded_s, 2),
        "step_s": round(time.perf_counter() - t0, 2),
        "bytes_written": step_written,
        "changed_bytes": changed,
        "bound_bytes": 2 * changed + 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def _other(value, generator):
    if isinstance(value, GaussianMixture):
        means = torch.randn(value.means.shape, generator=generator, dtype=torch.float64)
        return GaussianMixture(value.weights, means, means.abs() + 0.1, value.count)
    return torch.randn(value.shape, generator=generator)


VIEWS = (
    "status",
    "api_state",
    "check",
    "check_deep",
    "in_process",
    "repair_dry_run",
    "export",
    "predict_load",
    "step",
    "hashes",
)
HASHES = ("sha256", "blake2b", "blake2s", "sha1", "md5", "sha512")  # hashlib's, all stdlib


def hash_rates(path: Path) -> dict:
    """MB/s of each hashlib hash over ``path`` (the largest store file), streamed in 8 MiB
    chunks as ``framing.verify_file`` does, interleaved twice (the machine is shared): which
    checksum ``server check`` can afford."""
    rates: dict = {name: [] for name in HASHES}
    buffer = bytearray(8 * 2**20)
    view = memoryview(buffer)
    for _ in range(2):
        for name in HASHES:
            hasher, started = hashlib.new(name), time.perf_counter()
            with open(path, "rb") as file:
                while got := file.readinto(view):
                    hasher.update(view[:got])
            rates[name].append(path.stat().st_size / (time.perf_counter() - started) / 1e6)
    return {name: round(max(r)) for name, r in rates.items()} | {"load": os.getloadavg()[0]}


def measure(
    n: int, timeout: float, views: tuple[str, ...], keep: Path | None, before: Path | None
) -> dict:
    """The ``views`` of a federation of ``n`` classes, built in a temporary folder (or in
    ``keep``/<n>, built once and kept for later runs; the step then runs on a copy). With
    ``before`` (a checkout), ``check`` and the predict load are also run by its code, each
    right after this one's: their ratio is what the machine's load changes least."""
    root = keep / str(n) if keep else Path(tempfile.mkdtemp(prefix=f"starfed-big-{n}-"))
    try:
        started = time.perf_counter()
        built = (root / "server" / "federation" / "codebook.bin").is_file()
        folder = root / "server" / "federation" if built else build(root, n)
        result: dict = {"classes": n, "build_s": round(time.perf_counter() - started, 1)}
        result["whole_codebook_bytes"] = max(p.stat().st_size for p in folder.rglob("*.bin"))
        server = str(root / "server")
        starfed = [str(Path(sys.executable).parent / "starfed")]
        commands = {
            "status": [*starfed, "server", "status", "--dir", server, "--json"],
            "check": [*starfed, "server", "check", "--dir", server],
            "check_deep": [*starfed, "server", "check", "--dir", server, "--deep"],
            "repair_dry_run": [*starfed, "server", "repair", "--dir", server, "--dry-run"],
        }
        shim = _shim(root, before) if before else None
        for view in views:
            if view in commands:
                result[view] = timed(commands[view], timeout)
                if shim and view == "check":
                    cli = [
                        sys.executable,
                        "-c",
                        "import sys; from starfed.cli import main; sys.exit(main(sys.argv[1:]))",
                        *commands[view][1:],
                    ]
                    result["check_before"] = timed(cli, timeout, shim)
            elif view == "api_state":
                result[view] = python(API_STATE.format(server=server), timeout)
            elif view == "in_process":
                result[view] = python(IN_PROCESS.format(server=server), timeout)
        if "hashes" in views:
            result["hash_mb_per_s"] = hash_rates(
                max(folder.rglob("*.bin"), key=lambda p: p.stat().st_size)
            )
        out = root / "export.bin"
        if "export" in views:
            export = [*starfed, "server", "export", "--federation", str(folder), "--out", str(out)]
            result["export"] = timed(export, timeout)
            if out.exists():
                result["export"]["bytes"] = out.stat().st_size
        if "predict_load" in views and out.exists():
            result["predict_load"] = python(PREDICT_LOAD.format(path=str(out)), timeout)
            if shim:
                result["predict_load_before"] = python(
                    PREDICT_LOAD.format(path=str(out)), timeout, shim
                )
        if "step" in views:
            if keep:  # the kept folder stays as built
                shutil.copytree(folder, root / "step" / "federation")
                folder, server = root / "step" / "federation", str(root / "step")
            result["step"] = synthetic_step(folder)
            result["step"]["check_after"] = timed(
                [*starfed, "server", "check", "--dir", server], timeout
            )
        return result
    finally:
        for path in (root / "step", root / "path") if keep else (root,):
            shutil.rmtree(path, ignore_errors=True)


def _shim(root: Path, checkout: Path) -> dict:
    """The environment that imports ``starfed`` from ``checkout``."""
    shim = root / "path"
    if not shim.is_dir():
        shim.mkdir()
        (shim / "starfed").symlink_to(checkout.resolve())
    return {**os.environ, "PYTHONPATH": str(shim)}


def before_step(n: int, checkout: Path, timeout: float) -> dict:
    """The same step over a folder of the layout before the store, run by the code of
    ``checkout`` (a starfed checkout of that time): its bytes written, for comparison."""
    root = Path(tempfile.mkdtemp(prefix=f"starfed-before-{n}-"))
    try:
        folder = build(root, n, before=True)
        env = _shim(root, checkout)
        done = subprocess.run(
            [sys.executable, __file__, "--step-only", str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            return {"exit": done.returncode, "error": done.stderr.strip().splitlines()[-1:]}
        return {"checkout": str(checkout), **json.loads(done.stdout.splitlines()[-1])}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per command")
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="CHECKOUT",
        help="also run the step (N <= 1,000), check and the predict load with the code of "
        "this checkout (the step: one before the store)",
    )
    parser.add_argument("--step-only", type=Path, help=argparse.SUPPRESS)  # before_step's child
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--views", nargs="+", choices=VIEWS, default=VIEWS, help="what to measure (default: all)"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="build each federation once in DIR/<classes> and keep it",
    )
    args = parser.parse_args()
    if args.step_only:
        print(json.dumps(synthetic_step(args.step_only)))
        return
    results = []
    for n in args.classes:
        load = os.getloadavg()[0]
        result = {
            **measure(n, args.timeout, tuple(args.views), args.keep, args.compare_with),
            "load_1min_before": round(load, 1),
        }
        if args.compare_with and n <= COMPARE_UP_TO and "step" in args.views:
            result["step_before"] = before_step(n, args.compare_with, args.timeout)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
