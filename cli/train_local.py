"""`starfed train-local`: the command line of the single-site baseline.

Every value is checked against the configuration schema, and the results folder proven
writable, before torch, data or backbones are loaded; the run itself is
``starfed.simulations.train_local``.
"""

from __future__ import annotations

import argparse

from starfed.cli.flags import Flag, add_command, parsed, same_name, switch
from starfed.ops.exit_codes import EXIT_OK
from starfed.shared.knob import as_int, as_str, writable_dir

COMMAND = "train-local"
FLAGS = (
    *same_name("data-root"),
    Flag("--tasks", ("num-tasks",)),
    *same_name("classes-per-task", "seed", "cache-dir", "preset", "device", "backbone-config"),
    *same_name("clip-weights", "vit-weights"),
    switch("--download", "download", True),
    *same_name("vit-tag"),
    Flag("--epochs", ("stage1-epochs", "stage2-epochs"), help="local epochs of stages 1 and 2"),
    *same_name("batch-size"),
    Flag("--replay-epochs", ("replay1-epochs",)),
    switch("--no-generative-replay", "generative-replay", False, "ablation (paper, Tab. 3)"),
    switch("--unimodal", "mixture-components", 1, "ablation: one Gaussian instead of a mixture"),
    switch("--no-confidence-modulation", "confidence-modulation", False, "ablation"),
    switch("--classify-with-keys", "classify-with-keys", True, "ablation: predict with keys"),
    *same_name("results-dir", "run-name", "threads"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, COMMAND, _main, FLAGS)


def _main(args: argparse.Namespace) -> int:
    """single-site continual training over Split CropDiseases (the baseline)

    Train STAR-Prompt on one site, task after task, and evaluate on every seen task. Defaults:
    the bundled 28-class mini set (7 tasks × 4), tiny random backbones, the reference's Split
    CropDiseases hyper-parameters.
    """
    values, options, names = parsed(args, FLAGS, COMMAND)
    writable_dir(as_str(values, "results-dir"), names.get("results-dir", "results-dir"))

    import torch  # only now: a bad value above costs no second of loading

    from starfed.simulations.train_local import LocalRunOptions, run_local

    torch.set_num_threads(as_int(options, "threads"))
    run_local(LocalRunOptions.from_config(values, options))
    return EXIT_OK
