"""Output for people: the console every command prints through, progress bars for long loops,
the federation's log lines on that console, and counts and percentages in words. One rule for
width, here: a terminal is filled to its width; a file or a pipe has no width to fit, so nothing
there is cut or wrapped (a script or a log reads whole class names, paths and fingerprints)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import Progress

#: Columns of output into a file or a pipe (``COLUMNS`` when that is wider): room for a table
#: of whole class names and fingerprints.
PIPED_WIDTH = 240


class _Console(Console):
    """rich's console, but a reader that went away (``starfed evaluate … | head``) is Python's
    ``BrokenPipeError``, which ``cli.main`` answers with the shell's code for SIGPIPE as for a
    plain ``print``: rich's own answer is a silent exit 1, which reads as a failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # what is still buffered is dropped, not written again
        raise BrokenPipeError


def console(stderr: bool = False) -> Console:
    """The console a command prints through (on stdout, or stderr for progress and logs): the
    terminal's width in a terminal; piped, ``PIPED_WIDTH`` columns and plain lines not
    wrapped. No highlighting: names and paths are printed as they are."""
    out = _Console(stderr=stderr, highlight=False)
    if not out.is_terminal:
        columns = os.environ.get("COLUMNS", "")
        out.width = max(PIPED_WIDTH, int(columns) if columns.isdigit() else 0)
        out.soft_wrap = True
    return out


#: The logger every module of the federation writes its lines to (``logging.getLogger(__name__)``
#: under it): the core has one output channel; who runs it decides where the lines go.
LOGGER = "starfed"
#: How a line of each level looks on a console: failures red, warnings yellow, the rest plain.
LEVEL_STYLES = {logging.CRITICAL: "red", logging.ERROR: "red", logging.WARNING: "yellow"}


class ConsoleHandler(logging.Handler):
    """Log lines printed on a rich console, above its live progress bars, styled by level.

    rich's own ``RichHandler`` lays records out as a table (time, level, path columns); a
    command's output is plain lines, so this prints the message alone."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            style = LEVEL_STYLES.get(record.levelno)
            self.console.print(self.format(record), style=style, markup=False, highlight=False)
        except Exception:  # logging's contract: a handler never raises
            self.handleError(record)


@contextmanager
def logged_to(console: Console) -> Iterator[None]:
    """While inside, the federation's lines of level INFO and above print on ``console``
    (they still reach other handlers, e.g. a test's capture)."""
    logger = logging.getLogger(LOGGER)
    handler, level = ConsoleHandler(console), logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def counted(n: int, noun: str) -> str:
    """``1 site``, ``2 sites``, ``1 new class``, ``0 new classes``."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


def percent_text(value: float | None) -> str:
    """``41.67`` for a percentage in a table or a line; ``—`` where there is none (None, or NaN:
    no test image)."""
    return "—" if value is None or math.isnan(value) else f"{value:.2f}"


@contextmanager
def progress_task(
    progress: Progress | None, description: str, total: int
) -> Iterator[Callable[[], None]]:
    """Yield an ``advance()`` callable; a no-op when there is no progress display."""
    if progress is None:
        yield lambda: None
        return
    task = progress.add_task(description, total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.remove_task(task)
