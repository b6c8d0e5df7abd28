"""The shape of the tree (docs/design.md#the-layout), read from the source's import statements.

Every ``import`` of the package counts — at module level, inside functions and under
``if TYPE_CHECKING:`` (a cycle of types is a cycle of meaning, whether it runs or not). Three
layers, arrows one way: operations → federation → model; inside them, no edge the design points
the other way (``WRONG_WAY``, ``STEP_STAGES``). No import cycle. The model imports nothing from
Flower, and one module holds every import of a non-public Flower module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders that install as ``starfed.*`` (pyproject.toml's ``package-dir``).
FOLDERS = ("cli", "client", "server", "shared", "proto", "simulations", "host", "ops")
#: Flower modules whose names are Flower's public API (its documentation's import paths).
FLOWER_PUBLIC = {"flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.serverapp.strategy"}
FLOWER_INTERNALS = "starfed.ops.flower_internals"

#: Layer of a module, by prefix (the longest matching prefix wins); a module may import its
#: own layer and the layers below it.
LAYERS = {
    "starfed.host": 0,  # the operating system's: process identity, lock files
    "starfed.shared": 0,  # the model
    "starfed.proto": 0,
    "starfed.server": 1,  # the federation
    "starfed.client": 1,
    "starfed.ops": 2,  # operations: what the server's and the sites' share
    "starfed.server.ops": 2,  # operations
    "starfed.client.ops": 2,
    "starfed.server.serving": 2,
    "starfed.simulations": 3,  # what users run: research harness and the command line
    "starfed.cli": 3,
}
LAYER_NAMES = ("model", "federation", "operations", "commands")


def _modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = ["starfed", folder, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module name ``tree`` imports (``from a import b`` gives ``a.b`` where that is a
    module of the package, else ``a``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in MODULES else base
        yield from _imports(node, module, is_package)


IMPORTS: dict[str, set[str]] = {
    module: set(_imports(ast.parse(path.read_text()), module, path.name == "__init__.py"))
    for module, path in MODULES.items()
}


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    graph = {m: sorted(i for i in IMPORTS[m] if i in MODULES) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package():
    assert {"starfed.server.coordinator", "starfed.client.site", "starfed.cli"} <= MODULES.keys()
    assert "starfed.shared.model.training" in IMPORTS["starfed.client.site"]
    # an import under ``if TYPE_CHECKING:`` counts
    assert "starfed.shared.codebook.codebook" in IMPORTS["starfed.shared.codebook.lineage"]
    # a function-level import counts
    assert any(
        isinstance(node, ast.ImportFrom)
        for fn in ast.walk(ast.parse(MODULES["starfed.cli"].read_text()))
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
    )


def test_no_import_cycle():
    assert _cycles() == []


#: Edges the layers allow that point against the design: (importer, imported, why), by prefix.
WRONG_WAY = (
    ("starfed.ops", "starfed.server", "ops/ is what the server's and the sites' sides share"),
    ("starfed.ops", "starfed.client", "ops/ is what the server's and the sites' sides share"),
    ("starfed.simulations", "starfed.cli", "the command line reads the simulations, not back"),
)
#: A step's modules in the order its stages run (docs/design.md#one-step): each imports only
#: those before it.
STEP_STAGES = (
    "starfed.server.messaging",
    "starfed.server.decode",
    "starfed.server.screening",
    "starfed.server.field_bounds",
    "starfed.server.participants",
    "starfed.server.catch_up",
    "starfed.server.strategy",
    "starfed.server.coordinator",
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_edge_points_the_wrong_way():
    wrong = sorted(
        f"{module} imports {target}: {why}"
        for module, targets in IMPORTS.items()
        for target in targets
        for importer, imported, why in WRONG_WAY
        if _under(module, importer) and _under(target, imported)
    )
    backwards = sorted(
        f"{module} imports {target}, a later stage of the step"
        for index, module in enumerate(STEP_STAGES)
        for target in IMPORTS[module]
        if target in STEP_STAGES[index + 1 :]
    )
    assert wrong == [] and backwards == []


def test_layers_point_down():
    upward = [
        f"{module} ({LAYER_NAMES[_layer(module)]}) imports {target} ({LAYER_NAMES[_layer(target)]})"
        for module, targets in IMPORTS.items()
        for target in targets
        if target in MODULES and _layer(target) > _layer(module)
    ]
    assert upward == []


#: What the model layer never imports: Flower, and what opens a socket or starts a process.
NOT_IN_THE_MODEL = ("flwr", "grpc", "socket", "subprocess", "http", "urllib", "ray")


def test_the_model_imports_nothing_from_flower_and_opens_no_socket():
    """``shared/`` is computation and data: no Flower, no network client, no process (a
    device's copy of the codebook kept current is ``starfed.ops.follow``)."""
    outside = [
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        if _layer(module) == 0 and not module.startswith("starfed.host")
        for target in targets
        if target.split(".")[0] in NOT_IN_THE_MODEL
    ]
    assert outside == []


def test_flower_internals_are_imported_by_one_module():
    internal = {
        module
        for module, targets in IMPORTS.items()
        for target in targets
        if (target == "flwr" or target.startswith("flwr.")) and target not in FLOWER_PUBLIC
    }
    assert internal == {FLOWER_INTERNALS}


def test_a_cycle_would_be_found(monkeypatch):
    """The check itself: an edge back from the model to the coordinator closes a cycle."""
    back = IMPORTS["starfed.shared.protocol"] | {"starfed.server.coordinator"}
    monkeypatch.setitem(IMPORTS, "starfed.shared.protocol", back)
    assert any("starfed.server.coordinator" in cycle for cycle in _cycles())


def test_the_host_imports_nothing_else_of_starfed():
    """``host/`` (process identity, lock files) serves the server and the site alike: below
    every other layer, it depends on none."""
    outside = [
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        if module.startswith("starfed.host")
        for target in targets
        if target.startswith("starfed.") and not target.startswith("starfed.host")
    ]
    assert "starfed.host.locks" in MODULES and outside == []


def test_the_sites_operations_import_nothing_from_the_server_side():
    """``client/ops/`` runs on a site's machine: what it shares with the server is
    ``starfed.ops``; it never imports ``server/``."""
    server_side = [
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        if module.startswith("starfed.client.ops")
        for target in targets
        if target.startswith("starfed.server")
    ]
    assert "starfed.client.ops.site_options" in MODULES and server_side == []


def test_the_federation_writes_one_channel():
    """The federation layer (``server/``, ``client/``) writes lines for people through
    ``logging`` only: it imports no console library and prints nothing; who runs it (a
    ServerApp, a simulation, a command) shows the lines (``progress.logged_to``)."""
    federation = [module for module in MODULES if _layer(module) == 1]
    consoles = [
        f"{module} imports {target}"
        for module in federation
        for target in IMPORTS[module]
        if target == "rich" or target.startswith("rich.")
    ]
    printing = [
        f"{module}:{node.lineno} calls print"
        for module in federation
        for node in ast.walk(ast.parse(MODULES[module].read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
    ]
    assert "starfed.server.coordinator" in federation and consoles == [] and printing == []


def _knobs_read_from_command_tables(module: str) -> set[str]:
    """Keys of ``knob("KEY", ..., table=...)`` fields in ``module``: options read from a
    command's own table."""
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(MODULES[module].read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "knob"
        and any(keyword.arg == "table" for keyword in node.keywords)
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def test_the_commands_knobs_live_with_the_commands():
    """The model's knob table (``shared/config.py``) holds the run config's, a node's and the
    environment's knobs, and of the commands' options only those the model's own options read
    (train-local's ``generative-replay``: ``TrainConfig``); every other command option lives
    in the commands layer — the research commands' with the harness they drive
    (``simulations/research_knobs.py``), the others' in ``cli/command_knobs.py`` — which
    nothing below it imports."""
    from starfed.cli import command_knobs
    from starfed.shared import config
    from starfed.simulations import research_knobs

    model_reads = {
        key
        for module in MODULES
        if _layer(module) == 0
        for key in _knobs_read_from_command_tables(module)
    }
    in_the_model = {knob.key for knob in config.SCHEMA if knob.group == "command"}
    assert in_the_model == model_reads == {"generative-replay"}
    own = research_knobs.RESEARCH_KNOBS + command_knobs.COMMAND_KNOBS
    assert set(command_knobs.SCHEMA) == set(config.SCHEMA) | set(own)
    assert all(knob.group == "command" for knob in own)
    research = {c for knob in research_knobs.RESEARCH_KNOBS for c in knob.commands}
    assert research == {"train-local", "simulate", "experiment"}
    assert not research & {c for knob in command_knobs.COMMAND_KNOBS for c in knob.commands}
    commands = LAYER_NAMES.index("commands")
    assert _layer("starfed.cli.command_knobs") == _layer(research_knobs.__name__) == commands
