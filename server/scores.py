"""The federation's scores, from what every site reports on its own test images.

There is no global test set in a federation: each site evaluates the codebook on its own test
images of every class it has held and reports counts per class (``EvaluationReport``). Grouping
classes by the step that registered them gives one row of the federation's accuracy matrix —
the continual-learning view, with arrival steps in place of tasks. Each cell is the mean over
sites of each site's accuracy on that group, not the accuracy over all sites' images: image
counts are what a site says they are, and a site that says 10⁹ test images, all right, would
otherwise set the federation's FAA (docs/security.md#3-bounded-evaluation-reports); so weighted,
one site moves a cell by at most its 1/n share. With one site, or sites of equal test sets, the
two are the same. Per class the counts are still added over sites (the record's ``classes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from starfed.server.records import StepRecord, StepScores
from starfed.shared.metrics import AccuracyMatrix, percentage
from starfed.shared.report import EvaluationReport


def aggregate(
    reports: Iterable[tuple[str, EvaluationReport]],
    class_steps: Mapping[str, int],
    step: int,
    n_layers: int,
) -> StepScores:
    """Scores of one step from ``(site, report)`` pairs; ``class_steps`` maps every codebook
    class to the step that registered it. An arrival step's accuracy is the mean over the sites
    with test images of it of their own accuracy there (the module's docstring says why)."""
    classes: dict[str, dict] = {}
    sites: dict[str, dict] = {}
    # arrival step -> site -> [images, correct, selection hits]
    groups: list[dict[str, list[int]]] = [{} for _ in range(step + 1)]
    for site, report in reports:
        mine = sites.setdefault(site, {"images": 0, "correct": 0})
        for score in report.classes:
            total = classes.setdefault(
                score.name, {"images": 0, "correct": 0, "selection_hits": 0, "sites": 0}
            )
            total["images"] += score.images
            total["correct"] += score.correct
            total["selection_hits"] += score.selection_hits
            total["sites"] += 1
            mine["images"] += score.images
            mine["correct"] += score.correct
            arrival = class_steps.get(score.name)
            if arrival is not None and 0 <= arrival <= step:
                counts = groups[arrival].setdefault(site, [0, 0, 0])
                counts[0] += score.images
                counts[1] += score.correct
                counts[2] += score.selection_hits
    for mine in sites.values():
        mine["accuracy"] = percentage(mine["correct"], mine["images"])
    accuracy = [_site_mean(g, lambda c: percentage(c[1], c[0])) for g in groups]
    selection = [_site_mean(g, lambda c: percentage(c[2], c[0] * n_layers)) for g in groups]
    scored = [a for a in accuracy if not math.isnan(a)]
    mean = sum(scored) / len(scored) if scored else math.nan
    return StepScores(accuracy, selection, mean, sites, classes)


def _site_mean(group: Mapping[str, list[int]], percent: Callable[[list[int]], float]) -> float:
    """The mean over the sites with test images in ``group`` of ``percent`` of their counts."""
    values = [percent(counts) for counts in group.values() if counts[0]]
    return sum(values) / len(values) if values else math.nan


def accuracy_matrix(history: Iterable[StepRecord], server: bool = False) -> AccuracyMatrix:
    """The federation's matrix from its step records: row i after step i, column j the classes
    that arrived at step j (the sites' scores, or the server test set's)."""
    scores = (record.server_eval if server else record.scores for record in history)
    return [s.accuracy for s in scores if s is not None]


def selection_matrix(history: Iterable[StepRecord]) -> AccuracyMatrix:
    """The prompt-selection accuracy by arrival step, as ``accuracy_matrix``."""
    return [r.scores.selection_accuracy for r in history if r.scores is not None]
