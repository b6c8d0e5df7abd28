"""A site's evaluation report: per class, how its own test images were predicted.

Sites evaluate the codebook on their own test images and report counts, not accuracies, so the
server can add them up across sites (``proto/codebook.proto``, ``EvaluationReport``). Decoding
validates, like every message from a site.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.decoding import SCHEMA_VERSION, check_name
from starfed.shared.codebook.wire import DEFAULT_MAX_BYTES, parse
from starfed.shared.model.evaluation import ClassScores


@dataclass(frozen=True)
class ClassScore:
    name: str
    images: int
    correct: int
    selection_hits: int  # of images × n_layers prompt selections
    # of the wrong predictions, those into classes of the newest step the site has not held:
    # (class, images) pairs, each class once (``server.taken``)
    taken_by: tuple[tuple[str, int], ...] = ()


@dataclass
class EvaluationReport:
    fingerprint: str
    codebook_version: int
    classes: list[ClassScore] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        codebook: Codebook,
        scores: ClassScores,
        takers: Collection[int] = (),
        **metadata: str,
    ) -> EvaluationReport:
        """The report of ``scores`` counted on the codebook's classes (rows), for the classes
        that had test images; ``takers``: the rows whose wrong predictions it says per class
        (the newest step's classes the site has not held: what the server attributes)."""
        report = cls(codebook.fingerprint, codebook.version, metadata=dict(metadata))
        taken: dict[int, list[tuple[str, int]]] = {}
        for true, predicted, images in scores.mistaken.tolist():
            if predicted in takers:
                taken.setdefault(true, []).append((codebook.names[predicted], images))
        for row in torch.nonzero(scores.images).flatten().tolist():
            report.classes.append(
                ClassScore(
                    codebook.names[row],
                    int(scores.images[row]),
                    int(scores.correct[row]),
                    int(scores.selection_hits[row]),
                    tuple(taken.get(row, ())),
                )
            )
        return report

    def to_bytes(self) -> bytes:
        message = pb.EvaluationReport(
            schema_version=SCHEMA_VERSION,
            backbone_fingerprint=self.fingerprint,
            codebook_version=self.codebook_version,
            metadata=self.metadata,
        )
        for score in self.classes:
            message.classes.add(
                name=score.name,
                images=score.images,
                correct=score.correct,
                selection_hits=score.selection_hits,
                taken_by=[pb.ClassCount(name=n, images=i) for n, i in score.taken_by],
            )
        return message.SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, against: Codebook, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> EvaluationReport:
        """Decode a report on the codebook ``against`` (the one the evaluate phase sent)."""
        message = parse(pb.EvaluationReport, data, max_bytes)
        if message.schema_version != SCHEMA_VERSION:
            raise CodebookError(f"report schema version {message.schema_version}")
        if message.backbone_fingerprint != against.fingerprint:
            raise CodebookError("report made with other backbones")
        if message.codebook_version != against.version:
            raise CodebookError(
                f"report on codebook version {message.codebook_version}, "
                f"the codebook is at {against.version}"
            )
        n_layers = against.dims.n_layers
        seen: set[str] = set()
        scores = []
        for score in message.classes:
            problem = check_name(score.name)
            if problem or score.name not in against or score.name in seen:
                raise CodebookError(problem or f"report names class {score.name[:60]!r} badly")
            seen.add(score.name)
            taken_by = tuple((taker.name, taker.images) for taker in score.taken_by)
            takers = {name for name, _ in taken_by}
            if not (
                0 <= score.correct <= score.images
                and 0 <= score.selection_hits <= score.images * n_layers
                and all(images > 0 for _, images in taken_by)
                and sum(images for _, images in taken_by) <= score.images - score.correct
            ):
                raise CodebookError(f"report counts of {score.name[:60]!r} are inconsistent")
            if (
                len(takers) < len(taken_by)
                or score.name in takers
                or not all(name in against for name in takers)
            ):
                raise CodebookError(f"report names the takers of {score.name[:60]!r} badly")
            scores.append(
                ClassScore(score.name, score.images, score.correct, score.selection_hits, taken_by)
            )
        return cls(
            message.backbone_fingerprint, message.codebook_version, scores, dict(message.metadata)
        )
