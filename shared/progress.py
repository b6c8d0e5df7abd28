"""Progress bars for long loops: one rich task per loop, removed when the loop ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import Progress


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
