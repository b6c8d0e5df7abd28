"""Throughput of starfed's units of work, optionally interleaved with another checkout.

    python bench/speed.py --dims T --repeats 6 --compare-with /path/to/old/venv/bin/python

Each side runs in its own worker process (this script with ``--worker``) that builds its
model once; the parent asks the workers for one timed repetition at a time, alternating old
and new (and which goes first), so machine load hits both sides alike. The old side is
whatever ``starfed`` the other interpreter imports (today's layout or the pre-b48ceb8 one).

Units (images per second unless noted): stage-1 step with CLIP features computed / cached,
stage-2 training step, inference (CLIP query + prompted ViT) with CLIP features computed /
cached, mixture fit (seconds). Per unit: the median of ``--repeats`` runs, peak memory (RSS
on CPU, ``torch.cuda.max_memory_allocated`` on CUDA), FLOPs per image counted with
``torch.utils.flop_counter.FlopCounterMode`` and the achieved GFLOP/s as a share of the
device's measured peak (a large float32 matmul). Results go in bench/results/speed.md (the
summary in docs/benchmarks.md).

Dims: ``tiny`` (the test preset), ``T`` (bench/config-T-backbone.json, the dims of issue 9's
comparison with the reference) and ``paper`` (CLIP ViT-L/14 + ViT-B/16 at 224, random
weights, no download; run only on a GPU unless named explicitly).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIG_T = Path(__file__).resolve().parent / "config-T-backbone.json"
DIMS = ("tiny", "T", "paper")
N_PAST, N_SEEN = 8, 20  # 20 classes registered: 8 past, 12 in the current task
UNITS = ("stage1", "stage1_cached", "stage2", "inference", "inference_cached", "mog_fit")
UNIT_TITLES = {
    "stage1": "stage-1 step, CLIP features computed",
    "stage1_cached": "stage-1 step, cached CLIP features",
    "stage2": "stage-2 training step",
    "inference": "inference (CLIP query + prompted ViT)",
    "inference_cached": "inference, cached CLIP features",
    "mog_fit": "mixture fit (400 x d_vit, M = 5), s",
}
MOG_SAMPLES, MOG_COMPONENTS = 400, 5


# --- worker side (runs under either interpreter; imports only the starfed it finds) --------


def _import_starfed() -> dict[str, Any]:
    """The few starfed names the units need, from the b48ceb8+ layout or the older flat one."""
    try:
        from starfed.shared.codebook.mixture import GaussianMixture
        from starfed.shared.data.cropdiseases import SplitCropDiseases, bundled_dataset_root
        from starfed.shared.data.images import to_unit
        from starfed.shared.model import training
        from starfed.shared.model.backbones import create_backbones
        from starfed.shared.model.star_prompt import StarPrompt
    except ImportError:
        from starfed.shared import training  # type: ignore[no-redef]
        from starfed.shared.backbones import create_backbones  # type: ignore[no-redef]
        from starfed.shared.data import (  # type: ignore[no-redef]
            SplitCropDiseases,
            bundled_dataset_root,
            to_unit,
        )
        from starfed.shared.mixture import GaussianMixture  # type: ignore[no-redef]
        from starfed.shared.model import StarPrompt  # type: ignore[no-redef]
    try:  # the frozen towers' features: their own module since they left training.py
        from starfed.shared.model import features
    except ImportError:
        features = training
    return {
        "GaussianMixture": GaussianMixture,
        "SplitCropDiseases": SplitCropDiseases,
        "bundled_dataset_root": bundled_dataset_root,
        "to_unit": to_unit,
        "training": training,
        "features": features,
        "create_backbones": create_backbones,
        "StarPrompt": StarPrompt,
    }


def _flop_formulas() -> dict[Any, Any]:
    """FLOP formulas FlopCounterMode lacks: CPU flash attention, native MHA, in-place addmm."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def flash_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def flash_cpu_backward(
        grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
    ) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def native_mha(query_shape, key_shape, value_shape, embed_dim, num_head, *args, **kw) -> int:
        b, t, c = query_shape  # open_clip runs it batch-first
        d = c // num_head
        return 2 * b * t * c * 3 * c + 4 * b * num_head * t * t * d + 2 * b * t * c * c

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: flash_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: flash_cpu_backward,
        aten._native_multi_head_attention: native_mha,
        aten.addmm_: addmm_inplace,
    }


class Worker:
    """One side of the comparison: a model at the given dims and the units' closures."""

    def __init__(self, dims: str, device: str, threads: int, batch: int, seed: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)
        sf = _import_starfed()
        self.sf = sf
        training = sf["training"]
        if dims == "T":
            backbones = sf["create_backbones"](config_path=CONFIG_T)
        else:
            backbones = sf["create_backbones"](dims)
        if hasattr(backbones, "place"):  # half precision on a GPU (starfed.shared.device)
            backbones.place(self.device)
        else:  # before device support: float32 wherever it is put
            backbones.to(self.device)
        self.backbones = backbones
        split = sf["SplitCropDiseases"].from_root(sf["bundled_dataset_root"](), seed=1993)
        names = list(split.class_folders)
        model = sf["StarPrompt"](backbones)
        model.add_classes(names[:N_PAST], seed)
        model.add_classes(names[N_PAST:N_SEEN], seed)
        self.model = model
        g = torch.Generator().manual_seed(seed)
        size = backbones.config.image_size
        self.generator = g
        self.batch = batch
        n = 2 * batch
        # On the device, as a site keeps its decoded task there (training moves them anyway).
        images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.images = images.to(self.device)
        self.labels = torch.randint(N_PAST, N_SEEN, (n,), generator=g).to(self.device)
        self.views = sf["features"].Views.of(backbones)
        self.features = sf["features"].clip_features(backbones, self.images).to(self.device)
        d_vit = backbones.dims.d_vit
        self.mog_data = torch.randn(MOG_SAMPLES, d_vit, generator=g) + torch.arange(d_vit) / d_vit
        self.config = training.TrainConfig(stage1_epochs=1, stage2_epochs=1, batch_size=batch)
        self.units = {
            "stage1": (self._stage1, n),
            "stage1_cached": (self._stage1_cached, 4 * n),
            "stage2": (self._stage2, n),
            "inference": (self._inference, n),
            "inference_cached": (self._inference_cached, n),
            "mog_fit": (self._mog_fit, 1),
        }

    # The units. Each runs the public training / model API the way a site does.

    def _train(self, level: int, inputs: Any, labels: Any) -> None:
        """One stage's training call: ``stage1``/``stage2`` (task 0's random stream) given a
        ``TaskTraining`` today, the same with their arguments one by one in the b48ceb8+
        layout, ``train_first_level``/``train_second_level`` (a generator) before."""
        training = self.sf["training"]
        if hasattr(training, "stage1"):
            step = training.stage1 if level == 1 else training.stage2
            if hasattr(training, "TaskTraining"):
                step(training.TaskTraining(self.model, labels, N_PAST, self.config, 0), inputs)
            else:
                step(self.model, inputs, labels, N_PAST, self.config, 0)
            return
        step = training.train_first_level if level == 1 else training.train_second_level
        step(self.model, inputs, labels, N_PAST, self.config, self.generator)

    def _stage1_cached(self) -> None:
        self._train(1, self.features.repeat(4, 1), self.labels.repeat(4))

    def _stage1(self) -> None:
        features = self.sf["features"].clip_features(self.backbones, self.images)
        self._train(1, features, self.labels)

    def _stage2(self) -> None:
        self._train(2, self.images, self.labels)

    def _inference(self) -> None:
        with self.torch.no_grad():
            for i in range(0, len(self.images), self.batch):
                vit_in, clip_in = self.views.pair(
                    self.sf["to_unit"](self.images[i : i + self.batch])
                )
                z = self.backbones.clip_image_features(clip_in)
                self.model.predict(vit_in, z)

    def _inference_cached(self) -> None:
        with self.torch.no_grad():
            for i in range(0, len(self.images), self.batch):
                vit_in, _ = self.views.pair(self.sf["to_unit"](self.images[i : i + self.batch]))
                self.model.predict(vit_in, self.features[i : i + self.batch])

    def _mog_fit(self) -> None:
        self.sf["GaussianMixture"].fit(self.mog_data, MOG_COMPONENTS, seed=0)

    # Measurements.

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):  # Linux: "5" resets the peak RSS (VmHWM)
            Path("/proc/self/clear_refs").write_text("5")

    def _memory_bytes(self, key: str = "VmHWM") -> int:
        """Peak (``VmHWM``) or current (``VmRSS``) resident set; CUDA: allocated bytes."""
        if self.device.type == "cuda":
            if key == "VmHWM":
                return int(self.torch.cuda.max_memory_allocated(self.device))
            return int(self.torch.cuda.memory_allocated(self.device))
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def time_unit(self, unit: str) -> dict[str, Any]:
        run, images = self.units[unit]
        self._reset_peak()
        self._sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        self._sync()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        return {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "images": images,
            "peak_bytes": self._memory_bytes(),
            "load_1min": os.getloadavg()[0],
        }

    def tensor_peak(self, unit: str) -> dict[str, Any]:
        """Peak bytes of tensors the unit allocates (the RSS hides them: the heap keeps
        memory freed by the warm-up). From the profiler's allocation events on CPU."""
        if self.device.type == "cuda":
            return {"bytes": self.time_unit(unit)["peak_bytes"]}
        from torch.profiler import profile

        run, _ = self.units[unit]
        with profile(profile_memory=True) as prof:
            run()
        # Net bytes each op allocates itself (children excluded), in start order; "[memory]"
        # events are frees outside any op.
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        live = peak = 0
        for event in events:
            live += event.self_cpu_memory_usage
            peak = max(peak, live)
        return {"bytes": peak}

    def flops(self, unit: str) -> dict[str, Any]:
        from torch.utils.flop_counter import FlopCounterMode

        run, images = self.units[unit]
        with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
            run()
        return {"flops": counter.get_total_flops(), "images": images}

    def peak_gflops(self) -> dict[str, float]:
        """Best matmul rate of the device: float32 torch.mm, and oneDNN where it exists; on a
        GPU also float16, the precision the backbones run in there."""
        torch = self.torch
        n = 2048 if self.device.type == "cpu" else 8192
        a = torch.randn(n, n, device=self.device)
        b = torch.randn(n, n, device=self.device)
        rates = {}
        candidates = {"torch.mm": lambda: torch.mm(a, b)}
        if self.device.type == "cpu" and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            candidates["oneDNN linear"] = lambda: torch.ops.mkldnn._linear_pointwise(
                a, b, None, "none", [], ""
            )
        if self.device.type == "cuda":
            a16, b16 = a.half(), b.half()
            candidates["torch.mm float16"] = lambda: torch.mm(a16, b16)
        for name, fn in candidates.items():
            fn()
            best = float("inf")
            for _ in range(5):
                self._sync()
                start = time.perf_counter()
                fn()
                self._sync()
                best = min(best, time.perf_counter() - start)
            rates[name] = 2 * n**3 / best / 1e9
        return rates


def worker_main(args: argparse.Namespace) -> None:
    """Answer JSON requests on stdin, one line each; anything printed goes to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr
    worker = Worker(args.dims, args.device, args.threads, args.batch, args.seed)
    for run, _ in worker.units.values():
        run()  # warm-up: first-call allocations, lazy inits
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "time":
                reply: dict[str, Any] = worker.time_unit(request["unit"])
            elif op == "memory":
                reply = worker.tensor_peak(request["unit"])
            elif op == "flops":
                reply = worker.flops(request["unit"])
            elif op == "peak":
                reply = worker.peak_gflops()
            elif op == "info":
                import torch

                import starfed

                reply = {
                    "starfed": str(Path(starfed.__path__[0]).resolve()),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                }
            else:
                reply = {"error": f"unknown op {op}"}
        except Exception as err:  # a unit the other checkout cannot run
            reply = {"error": f"{type(err).__name__}: {err}"}
        protocol.write(json.dumps(reply) + "\n")


# --- parent side --------------------------------------------------------------------------


class Side:
    """A worker process of one checkout, driven line by line."""

    def __init__(self, label: str, python: str, args: argparse.Namespace, dims: str) -> None:
        self.label = label
        command = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            "--dims",
            dims,
            "--device",
            args.device,
            "--threads",
            str(args.threads),
            "--batch",
            str(args.batch),
            "--seed",
            str(args.seed),
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"{label} worker failed to start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(args: argparse.Namespace, dims: str, units: list[str]) -> dict[str, Any]:
    """Interleaved repetitions of every unit on every side, then FLOPs and the device peak."""
    sides = [Side("new", sys.executable, args, dims)]
    if args.compare_with:
        sides.insert(0, Side("old", args.compare_with, args, dims))
    try:
        info = {side.label: side.ask(op="info") for side in sides}
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
        peak: dict[str, float] = {}
        for rep in range(args.repeats):
            order = sides if rep % 2 == 0 else sides[::-1]
            for unit in units:
                for side in order:
                    samples.setdefault((side.label, unit), []).append(
                        side.ask(op="time", unit=unit)
                    )
            # The device's peak, once per round: the best of them is the least disturbed.
            for name, rate in sides[-1].ask(op="peak").items():
                peak[name] = max(peak.get(name, 0.0), rate)
        flops = {(s.label, u): s.ask(op="flops", unit=u) for s in sides for u in units}
        memory = {(s.label, u): s.ask(op="memory", unit=u) for s in sides for u in units}
    finally:
        for side in sides:
            side.close()
    result: dict[str, Any] = {"dims": dims, "info": info, "peak_gflops": peak, "units": {}}
    peak_rate = max(peak.values())
    for unit in units:
        row: dict[str, Any] = {}
        for side in sides:
            runs = samples[(side.label, unit)]
            if any("error" in r for r in runs):
                row[side.label] = {"error": next(r["error"] for r in runs if "error" in r)}
                continue
            seconds = statistics.median(r["seconds"] for r in runs)
            images = runs[0]["images"]
            counted = flops[(side.label, unit)]
            gflop_per_image = counted.get("flops", 0) / counted.get("images", 1) / 1e9
            rate = images / seconds
            row[side.label] = {
                "seconds": seconds,
                "per_s": rate,
                "all_seconds": [r["seconds"] for r in runs],
                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
                "load_1min": [r["load_1min"] for r in runs],
                "peak_rss_mb": max(r["peak_bytes"] for r in runs) / 2**20,
                "tensor_peak_mb": memory[(side.label, unit)].get("bytes", 0) / 2**20,
                "gflop_per_image": gflop_per_image,
                "gflops": gflop_per_image * rate,
                "share_of_peak": gflop_per_image * rate / peak_rate,
            }
        if "per_s" in row.get("old", {}) and "per_s" in row.get("new", {}):
            # Speed-ups (> 1: new is faster). "ratio" compares the medians; "paired" is the
            # median of old/new over the rounds (each pair ran back to back, so a burst of
            # load hits both); "best" compares the least-disturbed runs; "cpu" the CPU seconds.
            old_s, new_s = row["old"]["all_seconds"], row["new"]["all_seconds"]
            row["ratio"] = row["old"]["seconds"] / row["new"]["seconds"]
            row["paired"] = statistics.median(a / b for a, b in zip(old_s, new_s, strict=True))
            row["best"] = min(old_s) / min(new_s)
            row["cpu"] = row["old"]["cpu_seconds"] / row["new"]["cpu_seconds"]
        result["units"][unit] = row
    return result


def train_local_runs(args: argparse.Namespace) -> dict[str, Any]:
    """The default ``starfed train-local`` (seed 1993), old and new alternating, per-task times."""
    import tempfile

    sides = [("new", sys.executable)]
    if args.compare_with:
        sides.insert(0, ("old", args.compare_with))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for label, python in sides if rep % 2 == 0 else sides[::-1]:
                name = f"{label}-{rep}"
                command = [python, "-m", "starfed.cli", "train-local", "--seed", "1993"]
                command += ["--results-dir", tmp, "--run-name", name]
                command += ["--threads", str(args.threads)]
                start = time.perf_counter()
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
                elapsed = time.perf_counter() - start
                metrics = json.loads((Path(tmp) / name / "metrics.json").read_text())
                runs[label].append(
                    {
                        "process_s": elapsed,
                        "wall_s": metrics["wall_time_s"],
                        "task_s": metrics["task_wall_time_s"],
                        "faa": metrics["final_average_accuracy"],
                        "load_1min": os.getloadavg()[0],
                    }
                )
                print(
                    f"{name}: {elapsed:.1f} s (run {metrics['wall_time_s']:.1f} s; tasks "
                    + ", ".join(f"{t:.1f}" for t in metrics["task_wall_time_s"])
                    + f"), FAA {metrics['final_average_accuracy']:.2f}, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    return runs


def print_table(result: dict[str, Any], compare: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    peak = result["peak_gflops"]
    peak_text = ", ".join(f"{k} {v:.0f}" for k, v in peak.items())
    table = Table(title=f"dims {result['dims']} — device peak GFLOP/s: {peak_text}")
    table.add_column("unit")
    if compare:
        table.add_column("old", justify="right")
    table.add_column("new", justify="right")
    if compare:
        table.add_column("ratio", justify="right")
        table.add_column("paired / best / CPU-s", justify="right")
    table.add_column("GFLOP/img", justify="right")
    table.add_column("GFLOP/s (% peak)", justify="right")
    table.add_column("tensor peak MB" + (" old/new" if compare else ""), justify="right")

    def value(unit: str, cell: dict[str, Any]) -> str:
        if "error" in cell:
            return "n/a"
        return f"{cell['seconds']:.3f}" if unit == "mog_fit" else f"{cell['per_s']:,.0f}"

    for unit, row in result["units"].items():
        new = row["new"]
        cells = [UNIT_TITLES[unit]]
        if compare:
            cells.append(value(unit, row.get("old", {"error": "-"})))
        cells.append(value(unit, new))
        if compare:
            cells.append(f"{row['ratio']:.2f}x" if "ratio" in row else "-")
            cells.append(
                f"{row['paired']:.2f} / {row['best']:.2f} / {row['cpu']:.2f}"
                if "ratio" in row
                else "-"
            )
        if "error" in new or unit == "mog_fit":
            cells += ["-", "-"]
        else:
            cells.append(f"{new['gflop_per_image']:.3f}")
            cells.append(f"{new['gflops']:.0f} ({100 * new['share_of_peak']:.0f} %)")
        mems = [
            row[s]["tensor_peak_mb"] for s in ("old", "new") if s in row and "error" not in row[s]
        ]
        cells.append(" / ".join(f"{m:,.0f}" for m in mems) if mems else "-")
        table.add_row(*cells)
    console = Console(width=max(Console().width, 150))
    console.print(table)
    loads = [
        x
        for row in result["units"].values()
        for c in row.values()
        if isinstance(c, dict)
        for x in c.get("load_1min", [])
    ]
    if loads:
        console.print(
            f"1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dims",
        default=None,
        help="comma list of tiny, T, paper (default: tiny,T; plus paper when CUDA is present)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--repeats", type=int, default=6, help="timed runs per unit and side")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--units", default=",".join(UNITS), help=f"comma list of {', '.join(UNITS)}"
    )
    parser.add_argument(
        "--compare-with",
        metavar="PYTHON",
        help="interpreter of the other checkout (its venv's python); runs interleaved",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--train-local",
        action="store_true",
        help="instead: time the whole default `starfed train-local` (--repeats runs per side)",
    )
    parser.add_argument("--show", metavar="PATH", help="print the tables of a saved --json file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.show:
        saved = json.loads(Path(args.show).read_text())
        for result in saved["results"]:
            print_table(result, compare=any("ratio" in r for r in result["units"].values()))
        return
    if args.train_local:
        runs = train_local_runs(args)
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=2))
        return
    import torch

    if args.dims is None:
        dims = ["tiny", "T"] + (["paper"] if torch.cuda.is_available() else [])
    else:
        dims = [d.strip() for d in args.dims.split(",") if d.strip()]
    units = [u.strip() for u in args.units.split(",") if u.strip()]
    unknown = [u for u in units if u not in UNITS] + [d for d in dims if d not in DIMS]
    if unknown:
        parser.error(f"unknown units or dims: {unknown}")
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "device": args.device,
        "threads": args.threads,
        "batch": args.batch,
        "repeats": args.repeats,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": [],
    }
    for d in dims:
        result = measure(args, d, units)
        results["results"].append(result)
        print_table(result, compare=bool(args.compare_with))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
