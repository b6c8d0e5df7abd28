"""A guard against giants, not the rule: a module is cut where its responsibilities divide
(cohesion, docs/design.md#the-layout), and these limits only catch one that grew far past any
single subject: no production module over ``MAX_MODULE_LINES`` lines and no function over
``MAX_FUNCTION_LINES`` (generated protobuf modules aside). One that rings is cut along its
responsibilities, never squeezed or split into halves."""

from __future__ import annotations

import ast

from test_layers import MODULES

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def test_no_module_is_too_long() -> None:
    long = {
        module: lines
        for module, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert "starfed.server.coordinator" in MODULES and long == {}


def test_no_function_is_too_long() -> None:
    long = [
        f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
