"""What a step's new classes took from the classes the sites held before it: seen, not judged.

A step's new classes compete with every older class in the head and the first level, so each
takes some of the older classes' test images — the class-incremental price, paid by every site.
An attacker can aim it: ten lone classes of genuine images alike to another site's class (attack
5's disjoint variant, docs/security.md §1c) take that site's images without a statistic that
tells them from an honest site's classes alike to its own, which cost as much. What no check of
the attacker's rows can tell, the victim's own evaluation shows: each site reports, per class,
how many of its test images went to each class of the newest step it has not held
(``ClassScore.taken_by``). Here those counts are added up per site and per set of sites that
brought the classes, and what took more than ``TAKEN_BOUND`` points of a site's accuracy on its
earlier classes is recorded in the step's record (``StepRecord.taken``) and logged: the
operator sees who took what from whom, and `starfed server sites withdraw` takes a site's
classes out exactly.

It is a record, never a finding: a report is a site's word, and a site could name an honest
newcomer. So it quarantines no one and changes no codebook; its cost is one dictionary per
report, O(the report's test images), and the record at most 100 / ``TAKEN_BOUND`` entries per
reporting site (the points of one site's images add up to at most 100).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starfed.server.records import Taken
from starfed.shared.report import EvaluationReport

#: Points of a site's accuracy on its earlier classes: issue 43's goal (no attack by one site
#: costs an honest site more than 5 points, unseen).
TAKEN_BOUND = 5.0


def taken(
    reports: Iterable[tuple[str, EvaluationReport]],
    class_steps: Mapping[str, int],
    holders: Mapping[str, Iterable[str]],
    step: int,
) -> tuple[Taken, ...]:
    """What ``step``'s new classes took, over ``TAKEN_BOUND``, from each reporting site's
    classes of earlier steps; ``holders``: the sites that brought each class. Classes the
    reporting site brought itself are not takers (its report should not name them)."""
    found = []
    for site, report in reports:
        earlier = [s for s in report.classes if class_steps.get(s.name, step) < step]
        of = sum(s.images for s in earlier)
        by: dict[tuple[str, ...], dict[str, int]] = {}
        for score in earlier:
            for name, images in score.taken_by:
                brought = tuple(sorted(holders.get(name, ())))
                if class_steps.get(name) == step and brought and site not in brought:
                    classes = by.setdefault(brought, {})
                    classes[name] = classes.get(name, 0) + images
        for brought, classes in sorted(by.items()):
            record = Taken(site, brought, tuple(sorted(classes)), sum(classes.values()), of)
            if record.points > TAKEN_BOUND:
                found.append(record)
    return tuple(found)
