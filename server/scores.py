"""The federation's scores, added up from what every site reports on its own test images.

There is no global test set in a federation: each site evaluates the codebook on its own test
images of every class it has held and reports counts per class (``EvaluationReport``). Adding the
counts over sites gives each class's accuracy over all sites' test images (count-weighted), and
grouping classes by the step that registered them gives one row of the federation's accuracy
matrix — the continual-learning view, with arrival steps in place of tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from starfed.server.records import StepRecord, StepScores
from starfed.shared.metrics import AccuracyMatrix
from starfed.shared.report import EvaluationReport


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else math.nan


def aggregate(
    reports: Iterable[tuple[str, EvaluationReport]],
    class_steps: Mapping[str, int],
    step: int,
    n_layers: int,
) -> StepScores:
    """Scores of one step from ``(site, report)`` pairs; ``class_steps`` maps every codebook
    class to the step that registered it."""
    classes: dict[str, dict] = {}
    sites: dict[str, dict] = {}
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
    for mine in sites.values():
        mine["accuracy"] = _percent(mine["correct"], mine["images"])
    accuracy, selection = [], []
    for arrival in range(step + 1):
        group = [c for name, c in classes.items() if class_steps.get(name) == arrival]
        images = sum(c["images"] for c in group)
        accuracy.append(_percent(sum(c["correct"] for c in group), images))
        selection.append(_percent(sum(c["selection_hits"] for c in group), images * n_layers))
    scored = [a for a in accuracy if not math.isnan(a)]
    mean = sum(scored) / len(scored) if scored else math.nan
    return StepScores(accuracy, selection, mean, sites, classes)


def accuracy_matrix(history: Iterable[StepRecord], server: bool = False) -> AccuracyMatrix:
    """The federation's matrix from its step records: row i after step i, column j the classes
    that arrived at step j (the sites' scores, or the server test set's)."""
    scores = (record.server_eval if server else record.scores for record in history)
    return [s.accuracy for s in scores if s is not None]


def selection_matrix(history: Iterable[StepRecord]) -> AccuracyMatrix:
    """The prompt-selection accuracy by arrival step, as ``accuracy_matrix``."""
    return [r.scores.selection_accuracy for r in history if r.scores is not None]
