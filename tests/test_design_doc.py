"""docs/design.md shows the schema, the protocol and the layout as the code defines them."""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

from conftest import DEPLOYMENTS, TIER_OF, TIERS
from test_layers import IMPORTS

from starfed.cli import build_parser
from starfed.client.site import HANDLERS, Site
from starfed.server.coordinator import STATISTICS, Coordinator
from starfed.server.strategy import Strategy
from starfed.shared.codebook import schema
from starfed.shared.protocol import MESSAGES, PHASES, SYNC, Phase

ROOT = Path(__file__).parent.parent
NUMBERS = {4: "four", 5: "five", 6: "six"}
DESIGN = (ROOT / "docs" / "design.md").read_text()
START_HERE = (ROOT / "docs" / "start-here.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """Cells of the first table after ``heading``, header and rule excluded."""
    rows: list[list[str]] = []
    for line in DESIGN.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip(" `") for cell in line.strip("|").split("|")])
        elif rows:
            break
    assert rows, heading
    return rows[2:]


def test_schema_table_matches_the_schema() -> None:
    rows = [row for row in table_rows("## The codebook") if row[0] in schema.BY_NAME]
    assert [row[0] for row in rows] == [f.name for f in schema.FIELDS]
    for row, field in zip(rows, schema.FIELDS, strict=True):
        assert row[1] == field.symbol
        carried = field.trained_in.key if field.trained_in else "(server"
        assert row[3].startswith(carried), field.name
        assert row[4] == ("yes" if field.broadcast else "no")


def _hooks(phase: Phase) -> list[str]:
    """The strategy hooks the coordinator calls for a codebook phase's replies, in order."""
    if phase is Phase.EVALUATE:
        return ["aggregate_evaluation"]
    return ["aggregate_statistics", "replay"] if phase in STATISTICS else ["aggregate_training"]


def test_protocol_table_matches_the_protocol() -> None:
    """Every column of every row: the message, what is sent and returned, who answers with which
    stream, and who reduces the replies with which stream."""
    rows = table_rows("## The protocol")
    assert [row[0] for row in rows] == [spec.phase.key for spec in MESSAGES]
    for row, spec in zip(rows, MESSAGES, strict=True):
        _, message, sends, returns, handler, site_stream, server, server_stream = row
        assert message == spec.message_type
        assert sends == ("codebook" if spec.sends_codebook else "nothing")
        if spec.phase in HANDLERS:  # an update with exactly the fields the phase trains
            shown = re.findall(r"`?(\w+)`?", returns.removeprefix("update:"))
            assert shown == list(schema.trained_in(spec.phase)), spec.phase.key
            assert handler == HANDLERS[spec.phase].__name__
        else:
            assert returns == spec.returns, spec.phase.key
            owner = getattr(Site, handler.removeprefix("Site."))
            assert handler == f"Site.{owner.__name__}"
        assert site_stream == (spec.site_stream or "—")
        assert server_stream == (spec.server_stream or "—")
        if spec is SYNC:  # the coordinator's own, not a strategy's
            method = server.split(":")[0].strip(" `")
            assert hasattr(Coordinator, method.removeprefix("Coordinator."))
        else:
            hooks = re.findall(r"(aggregate_\w+|replay)\b", server)
            assert hooks == _hooks(spec.phase), spec.phase.key
            assert all(callable(getattr(Strategy, hook)) for hook in hooks)
    # the sync carries names and counts only: no class order, no codebook either way
    assert "order" not in SYNC.returns and not SYNC.sends_codebook
    assert set(HANDLERS) == {spec.phase for spec in PHASES} - {Phase.EVALUATE}
    for spec in PHASES:  # the message plan: which phase travels with which
        if spec.travels_with is Phase.SYNC:  # the next step's
            said = f"`{spec.phase.key}` travels with the next step's `sync`"
            assert said in DESIGN, said
        elif spec.travels_with is not None:
            said = f"`{spec.phase.key}` travels with the last `{spec.travels_with.name.lower()}`"
            assert said in DESIGN, said
    travelling = sum(spec.travels_with is not None for spec in PHASES)
    assert f"A step sends {NUMBERS[len(MESSAGES) - travelling]} messages" in DESIGN


def test_layout_links_point_at_the_tree() -> None:
    """Every repository path the layout section links to exists."""
    layout = DESIGN.split("## The layout", 1)[1]
    links = re.findall(r"\]\(\.\./([^)#]+)\)", DESIGN.split("## The model", 1)[0] + layout)
    assert len(links) > 10
    assert [link for link in links if not (ROOT / link).exists()] == []


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """Every command under ``parser`` that ``--help`` lists, with the module of the function it
    runs (a retired name, unlisted, is left out)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        yield " ".join(words), parser.get_default("func").__module__
        return
    for listed in sub._choices_actions:
        yield from _commands(sub.choices[listed.dest], (*words, listed.dest))


def test_commands_table_matches_the_command_line() -> None:
    """Each command, the module that reads its input, and files that exist for what it drives."""
    rows = table_rows("## Where each command's code is")
    expected = {
        command: module.replace("starfed.", "", 1).replace(".", "/") + ".py"
        for command, module in _commands(build_parser(), ("starfed",))
    }
    assert {row[0]: row[1] for row in rows} == expected
    assert len(rows) == len(expected)
    for row in rows:
        drives = re.findall(r"([\w/]+\.py)", row[2])
        assert drives, row[0]
        for path in drives:
            assert (ROOT / path).is_file(), f"{row[0]}: {path}"


def test_step_page_matches_the_pipeline() -> None:
    """docs/design.md's step page names each stage's call in ``Coordinator._run_phase`` in
    the order the code makes them, and each stage's module is one the coordinator imports."""
    rows = table_rows("### One step")
    assert [row[0] for row in rows] == [
        "plan",
        "send",
        "collect",
        "decode",
        "screen",
        "merge",
        "replay",
        "commit",
    ]
    source = inspect.getsource(Coordinator._run_phase)
    calls = list(dict.fromkeys(row[1] for row in rows))
    found = [source.index(f"{call}(") for call in calls]
    assert found == sorted(found), calls
    imported = IMPORTS["starfed.server.coordinator"]
    for row in rows:
        module = "starfed." + row[2].removesuffix(".py").replace("/", ".")
        assert (ROOT / row[2]).is_file() and module in imported, row


def test_start_here_names_files_of_the_tree() -> None:
    """docs/start-here.md, the first page, names only files that exist, and its step names
    the stages in the order of the step page."""
    named = r"\b((?:server|client|shared|simulations|cli|tests)/[\w/]+\.py)"
    paths = set(re.findall(named, START_HERE))
    assert len(paths) > 15 and [p for p in paths if not (ROOT / p).is_file()] == []
    stages = [row[0] for row in table_rows("### One step")]
    assert "phase  " + " → ".join(stages) in START_HERE


def test_start_heres_recipes_name_what_their_files_define() -> None:
    """Each name the page's recipes put in backticks (``MERGE_STRATEGIES``, ``_baseline_run``,
    ...) is a word of the files the recipe names: a rename that leaves the page behind fails."""
    named = r"\b((?:server|client|shared|simulations|cli|tests)/[\w/]+\.py)"
    for recipe in ("## Add a merge rule", "## Add a baseline"):
        section = START_HERE.split(recipe, 1)[1].split("\n## ", 1)[0]
        text = "".join((ROOT / p).read_text() for p in set(re.findall(named, section)))
        names = set(re.findall(r"`@?([A-Za-z_]\w*)(?:\(.*?\))?`", section))
        assert names and [n for n in names if not re.search(rf"\b{n}\b", text)] == [], recipe


def test_the_test_tiers_name_modules_of_the_tree() -> None:
    """docs/start-here.md's four tiers are ``tests/conftest.py``'s: each a marker registered in
    pyproject.toml, each module it names a test module that exists."""
    markers = (ROOT / "pyproject.toml").read_text()
    for tier in ("unit", *TIERS):
        assert f'"{tier}: ' in markers and f"`pytest -m {tier}`" in START_HERE, tier
    assert [m for m in TIER_OF if not (ROOT / "tests" / f"{m}.py").is_file()] == []


def test_every_module_that_starts_a_deployment_is_in_one_group() -> None:
    """A module that starts a deployment (``tests/deployed.py``) is one of ``DEPLOYMENTS``,
    run one after another on one worker: two deployments side by side missed their deadlines;
    each module ``DEPLOYMENTS`` names exists."""
    modules = {p.stem: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    imports = re.compile(r"^from deployed import", re.M)
    deploying = {m for m, text in modules.items() if imports.search(text)}
    assert deploying - set(DEPLOYMENTS) == set()
    assert set(DEPLOYMENTS) - set(modules) == set()
