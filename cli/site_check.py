"""``starfed site check``: is this site ready to join? (``starfed.client.ops.check`` does the work.)

Every input is checked first (exit 2 for bad flags, an unreadable ``--codebook``, a malformed
``--fingerprint``); then the report: exit 0 when ready, 1 when a problem would stop the site.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from starfed.cli._common import add_switches, guard
from starfed.cli.flags import add_command, add_run_config, parsed, run_config_pairs, same_name
from starfed.client.ops import site_options
from starfed.ops.exit_codes import EXIT_FAILED, EXIT_OK
from starfed.shared.codebook.framing import CodebookError, read_message
from starfed.shared.config import parse
from starfed.shared.knob import ConfigError
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.progress import counted

COMMAND = "site check"
FLAGS = same_name("preset", "backbone-config", "clip-weights", "vit-weights")
MARKS = {"ok": "ok  ", "warning": "WARN", "problem": "FAIL"}


def add_action(actions: argparse._SubParsersAction) -> None:
    """Register ``check`` on the ``site`` group."""
    parser = add_command(actions, "check", guard()(run_check), FLAGS, table=COMMAND)
    parser.add_argument("--data", type=Path, required=True, help="the site's data folder")
    parser.add_argument(
        "--state",
        type=Path,
        help="the site's state folder (default: as `site start`, from --name)",
    )
    parser.add_argument("--name", help="site name (default: the data folder's)")
    parser.add_argument(
        "--policy", type=Path, help="the policy `site start --policy` will get (default: STATE's)"
    )
    add_run_config(parser)  # the server's: what the policy would refuse under it
    expected = parser.add_mutually_exclusive_group()
    expected.add_argument(
        "--codebook",
        type=Path,
        help="a codebook of the federation (e.g. an export): its backbone fingerprint",
    )
    expected.add_argument(
        "--fingerprint",
        help="the federation's backbone fingerprint (hex, a prefix will do): `server status` "
        "shows it once the first round ran; before, `site check` with the federation's "
        "--preset/--backbone-config prints it",
    )
    add_switches(parser, {"--json": "one JSON object on stdout"})


def _expected_fingerprint(args: argparse.Namespace) -> str | None:
    if args.codebook is not None:
        try:
            return read_message(args.codebook).backbone_fingerprint
        except (OSError, CodebookError) as err:
            raise ConfigError(f"--codebook {args.codebook}: {err}") from None
    if args.fingerprint is not None:
        text = args.fingerprint.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{8,64}", text):
            raise ConfigError(
                f"--fingerprint {args.fingerprint}: expected 8 to 64 hex digits (a prefix is "
                "enough)"
            )
        return text
    return None


def run_check(args: argparse.Namespace) -> int:
    """check the data folder, images, backbones and state folder before joining

    Read the data folder as the site will: tasks in order with their classes and image counts,
    test images, class names that collide, unreadable images (each is decoded); build the
    backbones (the federation's --preset/--backbone-config/weights) and compare their
    fingerprint with the federation's; check the state folder. Exit 0 ready, 1 a problem would
    stop the site, 2 bad input.
    """
    values, _, _ = parsed(args, FLAGS, COMMAND)
    backbones = BackboneOptions.from_config(values)
    expected = _expected_fingerprint(args)
    data = args.data.expanduser().resolve()
    name = args.name or site_options.site_name_from(data)
    state = args.state.expanduser() if args.state else site_options.default_state_dir(name)

    from starfed.client.ops.check import check_site  # torch: only once the input is good

    server_run = None
    if args.run_config:
        server_run = parse(run_config_pairs(args.run_config), "run-config")
    report = check_site(
        data,
        state.resolve(),
        backbones,
        expected,
        progress=not args.json,
        policy=args.policy,
        run_config=server_run,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print(report)
    return EXIT_OK if report.ready else EXIT_FAILED


def _print(report) -> None:
    print(f"site check: data {report.data}")
    print(f"            state {report.state}")
    for index, task in enumerate(report.tasks, 1):
        classes = ", ".join(f"{c} ({n})" for c, n in task.classes.items()) or "no classes"
        print(f"  task {index} {task.name}: {classes}")
    if report.test_images:
        tests = ", ".join(f"{k} ({n})" for k, n in report.test_images.items())
        print(f"  test images by class: {tests}")
    for finding in report.findings:
        print(f"{MARKS[finding.level]} {finding.topic}: {finding.message}")
    problems = sum(f.level == "problem" for f in report.findings)
    if report.ready:
        print("ready to join: starfed site start --data … (docs/deployment.md)")
    else:
        print(f"not ready: {counted(problems, 'problem')} above would stop the site")
