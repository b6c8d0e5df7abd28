"""Every relative link of the documentation resolves. README.md, docs/ and bench/ (the benchmark
logs in bench/results/ among them) link each other by path and by heading; a file moved or a
heading renamed leaves links behind that GitHub shows as broken, and docs/benchmarks.md's
headings are linked from code comments too. Anchors are GitHub's: the heading lower-cased, its
punctuation but ``-`` and ``_`` dropped, spaces as ``-``, a repeated one suffixed ``-1``, ``-2``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("bench/**/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.+)")
URL = re.compile(r"[a-z][a-z0-9+.-]*:")


def _outside_code(page: Path) -> Iterator[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(page: Path) -> set[str]:
    """The anchor GitHub gives each heading of ``page``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _outside_code(page):
        if heading := HEADING.match(line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(page: Path) -> Iterator[tuple[int, str]]:
    """Each relative link target of ``page`` (inline code holds none), with its line."""
    for number, line in _outside_code(page):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not URL.match(target):
                yield number, target


def resolves(page: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
        return False
    return not anchor or linked.suffix != ".md" or anchor in anchors(linked)


def test_every_relative_link_resolves() -> None:
    links = [(page, number, target) for page in PAGES for number, target in relative_links(page)]
    broken = [
        f"{page.relative_to(ROOT)}:{number}: {target}"
        for page, number, target in links
        if not resolves(page, target)
    ]
    assert len(links) > 200 and broken == []


def test_anchors_and_links_are_read_as_github_does(tmp_path: Path) -> None:
    """The check itself: GitHub's anchors, repeats numbered; links in code are not links."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Experiment cells at once (`--jobs`)\n## A federation of 10,000 classes\n"
        "## Notes\n## Notes\n```\n# not a heading [x](gone.md)\n```\n"
        "See [cells](#experiment-cells-at-once---jobs), `[y](gone.md)` and [z](gone.md#a).\n"
    )
    assert anchors(page) == {
        "experiment-cells-at-once---jobs",
        "a-federation-of-10000-classes",
        "notes",
        "notes-1",
    }
    assert list(relative_links(page)) == [
        (8, "#experiment-cells-at-once---jobs"),
        (8, "gone.md#a"),
    ]
    assert resolves(page, "#notes-1") and not resolves(page, "#notes-2")
    assert not resolves(page, "gone.md#a")
