"""The dashboard's page: Jinja2 templates (``templates/dashboard_*.html``).

The page (``dashboard_page.html``) holds the style, the script that swaps the live part in every
few seconds, and the live part itself (``dashboard_live.html``, what ``/live`` answers); the
tables, badges and figures are macros (``dashboard_macros.html``). Markup lives in the templates
only: everything this module hands them is data, and autoescaping is on for every template, so a
class, site, log or file name is text on the page whatever characters it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from starfed.server.ops import status
from starfed.server.ops.dashboard_plots import COLOURS, PLOTS, digest, step_label
from starfed.server.ops.dashboard_state import PHASE_ORDER, RUNNING, State
from starfed.shared.metrics import LABEL_EVERY_TASK, short_class_name
from starfed.shared.progress import counted, percent_text

#: the hover text of a class one site brought alone (``status.ClassRow.single_site``)
SINGLE_SITE = (
    "brought by one site alone: no median over sites checks its rows, only the "
    "screening's references (docs/security.md)"
)
PAGE = "dashboard_page.html"
LIVE = "dashboard_live.html"


def _dash(value: object) -> object:
    """A missing value as a dash, so an empty cell reads as "nothing", not as a gap."""
    return "—" if value is None or value == "" else value


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


def _brought_by(sites: dict[str, str]) -> str:
    return ", ".join(f"{site} ({when})" for site, when in sites.items())


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=StrictUndefined,  # a misspelt field fails the page (and its tests)
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        dash=_dash,
        percent=percent_text,
        mib=_mib,
        short=short_class_name,
        counted=counted,
        brought_by=_brought_by,
    )
    env.globals.update(
        colours=COLOURS,
        phases=PHASE_ORDER,
        RUNNING=RUNNING,
        single_site=SINGLE_SITE,
        step_label=step_label,
    )
    return env


TEMPLATES = _environment()


@dataclass(frozen=True)
class Figure:
    """A plot as the page places it: its address carries its data's digest (None: no data)."""

    title: str
    src: str | None


def _figures(state: State) -> dict[str, Figure]:
    figures = {}
    for name, plot in PLOTS.items():
        data = plot.data(state)
        figures[name] = Figure(plot.title, f"plots/{name}.png?v={digest(data)}" if data else None)
    return figures


def _notes(s: status.Status) -> list[str]:
    """What could not be read, for the "cannot read" box."""
    notes = [*s.unreadable, *([s.problem] if s.problem else [])]
    if s.sites_error:
        notes.append(f"the SuperLink's node list: {s.sites_error}")
    return notes


def context(state: State) -> dict[str, Any]:
    """What the live part's template reads: the state and what the page derives from it."""
    return {
        "state": state,
        "s": state.status,
        "run": state.running,
        "notes": _notes(state.status),
        "figures": _figures(state),
        "details": {(d.step, d.attempt): d for d in state.steps},
        "wide_matrix": len(state.accuracy_matrix) > LABEL_EVERY_TASK,
    }


def page_context(state: State, refresh_s: float) -> dict[str, Any]:
    """What the whole page's template reads: the live part's, and how often it updates."""
    return {
        **context(state),
        "server_name": Path(state.status.server_dir).name,
        "refresh": f"{refresh_s:g}",
        "every_ms": int(refresh_s * 1000),
        "noscript_s": max(int(refresh_s), 1) * 2,  # without script: the whole page, slower
    }


def page(state: State, refresh_s: float) -> str:
    """The whole page: what ``/`` answers."""
    return TEMPLATES.get_template(PAGE).render(page_context(state, refresh_s))


def fragment(state: State) -> str:
    """The page's live part: what ``/live`` answers and the script swaps in."""
    return TEMPLATES.get_template(LIVE).render(context(state))
