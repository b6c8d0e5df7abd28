"""What a step's new classes took from the sites' earlier classes (``server.taken``): the
sites' reports carry it, decoding checks it, the server adds it up and records what is over
``TAKEN_BOUND`` — against the sites that brought the classes, never the reporting site."""

from __future__ import annotations

import pytest
import torch

from starfed.server.records import StepRecord, Taken
from starfed.server.taken import TAKEN_BOUND, taken
from starfed.shared.codebook.codebook import CodebookError
from starfed.shared.model.evaluation import ClassScores
from starfed.shared.report import ClassScore, EvaluationReport

pytestmark = pytest.mark.unit


def test_a_report_says_only_what_the_newest_steps_other_classes_took(make_codebook) -> None:
    """Of a class's wrong predictions, those into the ``takers`` rows, per taker; decoding the
    bytes gives the same report."""
    codebook = make_codebook(n_classes=4)
    a, b, c, d = codebook.names
    counts = torch.tensor([5, 5, 0, 0])
    mistaken = torch.tensor([[0, 1, 1], [0, 2, 2], [0, 3, 1], [1, 3, 3]])
    scores = ClassScores(counts, torch.tensor([1, 2, 0, 0]), counts * 0, counts * 2, mistaken)
    report = EvaluationReport.of(codebook, scores, {2, 3}, site="farm-b")
    assert [(s.name, s.taken_by) for s in report.classes] == [
        (a, ((c, 2), (d, 1))),
        (b, ((d, 3),)),
    ]
    assert EvaluationReport.from_bytes(report.to_bytes(), against=codebook) == report


@pytest.mark.parametrize(
    ("taken_by", "error"),
    [
        ((("c", 3), ("d", 2)), "inconsistent"),  # 5 wrong of 4
        ((("c", 0),), "inconsistent"),
        ((("c", 1), ("c", 1)), "badly"),
        ((("a", 1),), "badly"),  # itself
        ((("nowhere", 1),), "badly"),
    ],
)
def test_a_report_whose_takings_do_not_add_up_is_refused(make_codebook, taken_by, error) -> None:
    codebook = make_codebook(n_classes=4)
    names = dict(zip("abcd", codebook.names, strict=True))
    named = tuple((names.get(n, n), images) for n, images in taken_by)
    report = EvaluationReport(codebook.fingerprint, codebook.version)
    report.classes.append(ClassScore(names["a"], 5, 1, 0, named))
    with pytest.raises(CodebookError, match=error):
        EvaluationReport.from_bytes(report.to_bytes(), against=codebook)


STEPS = {"A1": 0, "B1": 0, "C2": 1, "X2": 1, "M2": 1, "N2": 1, "S2": 1}
HOLDERS = {
    "A1": {"farm-a"},
    "B1": {"farm-b"},
    "X2": {"farm-m"},
    "M2": {"farm-m"},
    "N2": {"farm-n"},
    "S2": {"farm-b", "farm-n"},
    "C2": {"farm-b"},
}


def report(*classes: ClassScore) -> EvaluationReport:
    return EvaluationReport("f", 3, list(classes))


def test_what_a_sites_new_classes_took_over_the_bound_is_recorded_against_it() -> None:
    """farm-b's 20 test images of B1: farm-m's X2 and M2 took 4 (20 points), farm-n's N2 one
    (5: not over the bound), the class farm-b brought with farm-n one (its own: not counted),
    and a class of farm-b's step-1 task (C2) is not an earlier class."""
    b = report(
        ClassScore("B1", 20, 10, 0, (("X2", 3), ("M2", 1), ("N2", 1), ("S2", 1))),
        ClassScore("C2", 10, 0, 0, (("X2", 10),)),
    )
    [found] = taken([("farm-b", b)], STEPS, HOLDERS, step=1)
    assert found == Taken("farm-b", ("farm-m",), ("M2", "X2"), 4, 20)
    assert found.points == 20.0 > TAKEN_BOUND
    assert found.line(1).startswith("step 1's classes of farm-m took 20.0 points of farm-b's")
    assert taken([("farm-b", b)], STEPS, HOLDERS, step=2) == ()  # nothing new at step 2


def test_a_shared_new_class_is_recorded_against_the_sites_that_brought_it() -> None:
    a = report(ClassScore("A1", 10, 5, 0, (("S2", 2),)))
    [found] = taken([("farm-a", a)], STEPS, HOLDERS, step=1)
    assert (found.by, found.classes, found.points) == (("farm-b", "farm-n"), ("S2",), 20.0)


def test_what_was_taken_reads_back_from_the_steps_record() -> None:
    record = StepRecord(1, "completed", 0.0, 1.0, taken=(Taken("b", ("m",), ("X",), 4, 20),))
    assert StepRecord.from_json(record.to_json()) == record
    assert "taken" not in StepRecord(1, "completed", 0.0, 1.0).to_json()
