"""Inference with a deployed codebook: what an inference-only device runs (docs/inference.md).

A device holds the two frozen backbones and a deployable codebook (``starfed server export``,
or a copy the codebook service keeps current); it trains nothing. ``Predictor`` is the
codebook's model there: the backbones checked against the codebook's fingerprint, the bank
loaded once. Each image gets the class the replay-aligned head predicts, its softmax
probability, and the task its prompts came from — the step that registered the class selected
in most ViT blocks (the second level picks one class per block; a tie goes to the earlier
class). ``LabelledImages`` scores a codebook on a folder of labelled test images; the server's
optional test set is one, so a device and the server count the same way.

What the model needs besides tensors travels in the codebook's metadata
(``starfed.shared.codebook.deployment``), so a device needs only the codebook file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.deployment import class_steps, confidence_modulation
from starfed.shared.data.images import DatasetError, decode_quietly, to_unit
from starfed.shared.data.site_folder import class_key, folder_test_images
from starfed.shared.metrics import nan_to_none, percentage
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import ClassScores, group_scores, score_classes
from starfed.shared.model.features import Views, clip_features
from starfed.shared.model.star_prompt import StarPrompt


def check_backbones(codebook: Codebook, backbones: Backbones) -> None:
    """A codebook is only valid with the backbones it was trained with."""
    if backbones.fingerprint != codebook.fingerprint:
        raise CodebookError(
            f"the codebook was trained with other backbones (fingerprint "
            f"{codebook.fingerprint[:12]}…, these are {backbones.fingerprint[:12]}…): load the "
            "federation's with --preset/--backbone-config/--clip-weights/--vit-weights"
        )


def codebook_model(codebook: Codebook, backbones: Backbones) -> StarPrompt:
    """The model of ``codebook`` on its backbones, on the backbones' device."""
    check_backbones(codebook, backbones)
    model = StarPrompt(backbones, confidence_modulation=confidence_modulation(codebook))
    model.load_bank(codebook.bank())
    return model


@dataclass(frozen=True)
class ImagePrediction:
    path: str
    name: str  # predicted class
    probability: float  # softmax of the aligned head's logits, for that class
    task: int  # registration step (1-based, as users see steps) of the class selected most


class Predictor:
    """A codebook's model on a device, for image files."""

    def __init__(self, codebook: Codebook, backbones: Backbones) -> None:
        self.codebook = codebook
        self.steps = class_steps(codebook)
        self.model = codebook_model(codebook, backbones)
        self.backbones = backbones
        self._device = backbones.device

    @torch.no_grad()
    def classify(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(class row, its probability, the most selected row) per uint8 image ``[B, 3, S, S]``."""
        images = images.to(self._device)
        features = clip_features(self.backbones, images)
        vit_in, _ = Views.of(self.backbones).pair(to_unit(images))
        prediction = self.model.predict(vit_in, features)
        probability, rows = torch.softmax(prediction.logits, dim=-1).max(dim=-1)
        votes = F.one_hot(prediction.selected, len(self.model.bank)).sum(dim=1)  # [B, C]
        return rows.cpu(), probability.cpu(), votes.argmax(dim=-1).cpu()  # ties: first class

    def predict_files(
        self, paths: Sequence[str], batch_size: int
    ) -> Iterator[tuple[list[ImagePrediction], list[str]]]:
        """Per batch of ``paths``: the predictions of the readable images and the unreadable
        paths (decoded as the reference's test view: ``decode_images``)."""
        names = self.codebook.names
        for start in range(0, len(paths), batch_size):
            batch = list(paths[start : start + batch_size])
            decoded, skipped = decode_quietly(  # unreadable files are returned, one by one
                [(p, i) for i, p in enumerate(batch)], self.backbones.config.image_size
            )
            kept = decoded.labels.tolist()
            if not kept:
                yield [], skipped
                continue
            rows, probability, tasks = (t.tolist() for t in self.classify(decoded.images))
            columns = zip(kept, rows, probability, tasks, strict=True)
            predictions = [
                ImagePrediction(batch[i], names[row], p, self.steps[names[task]] + 1)
                for i, row, p, task in columns
            ]
            yield predictions, skipped


class LabelledImages:
    """Test images of a folder with their classes (``folder_test_images``), decoded and
    CLIP-encoded once, scored against any codebook whose classes they share by class key."""

    def __init__(self, folder: str | Path, backbones: Backbones) -> None:
        classes = folder_test_images(folder)
        self.keys = sorted(classes)  # label i is the class key keys[i]
        # what the folder calls each class (its folder's name), for people: `Blueberry___healthy`
        self.folder_names = {key: Path(paths[0]).parent.name for key, paths in classes.items()}
        samples = [(p, i) for i, key in enumerate(self.keys) for p in classes[key]]
        if not samples:
            raise DatasetError(f"{folder}: no test images (class folders, or a site's test/)")
        self.test, self.unreadable = decode_quietly(samples, backbones.config.image_size)
        self.features = clip_features(backbones, self.test.images)

    def rows(self, names: Sequence[str]) -> torch.Tensor:
        """Each image's true row among ``names`` (a codebook's classes); -1: not among them."""
        row_of = {class_key(name): row for row, name in enumerate(names)}
        return torch.tensor([row_of.get(self.keys[int(i)], -1) for i in self.test.labels])

    def score(
        self,
        model: StarPrompt,
        group_of_row: torch.Tensor,
        confusion: torch.Tensor | None = None,
        use_keys: bool = False,
    ) -> ClassScores:
        """``score_classes`` on the images of the model's classes (the others are left out)."""
        rows = self.rows(model.bank.names)
        known = rows >= 0
        images, features = self.test.images[known], self.features[known]
        return score_classes(
            model, images, rows[known], features, group_of_row, use_keys, confusion
        )


@dataclass
class Evaluation:
    """A codebook scored on a folder of labelled test images."""

    names: list[str]  # the codebook's classes, in row order
    steps: dict[str, int]  # class -> registration step
    scores: ClassScores
    confusion: torch.Tensor  # int64 [C, C]: true row x predicted row
    left_out: dict[str, int]  # the folder's classes (its names) the codebook lacks -> images
    unreadable: list[str]  # image files that could not be decoded

    def to_dict(self) -> dict[str, object]:
        """Accuracy and prompt-selection accuracy per class, per task (registration step,
        1-based as users see steps) and overall, in % (None where there is no test image), and
        the confusion matrix."""
        s = self.scores
        group = torch.tensor([self.steps[name] for name in self.names], dtype=torch.long)
        classes = [
            {
                "name": name,
                "step": self.steps[name] + 1,
                "images": int(s.images[row]),
                "correct": int(s.correct[row]),
                "accuracy": percentage(int(s.correct[row]), int(s.images[row])),
                "selection_accuracy": percentage(
                    int(s.selection_hits[row]), int(s.selections[row])
                ),
            }
            for row, name in enumerate(self.names)
        ]
        by_task = group_scores(s, group, max(self.steps.values(), default=-1) + 1)
        tasks = [
            {
                "step": step + 1,
                "classes": int((group == step).sum()),
                "images": int(s.images[group == step].sum()),
                "accuracy": by_task.accuracy[step],
                "selection_accuracy": by_task.selection_accuracy[step],
            }
            for step in sorted(set(self.steps.values()))
        ]
        # NaN (no test image) is None in JSON
        return nan_to_none(
            {
                "images": int(s.images.sum()),
                "accuracy": percentage(int(s.correct.sum()), int(s.images.sum())),
                "selection_accuracy": percentage(
                    int(s.selection_hits.sum()), int(s.selections.sum())
                ),
                "classes": classes,
                "tasks": tasks,
                "left_out": self.left_out,
                "unreadable": len(self.unreadable),
                "unreadable_files": self.unreadable,
                "confusion_matrix": self.confusion.tolist(),
            }
        )


def evaluate(codebook: Codebook, backbones: Backbones, folder: str | Path) -> Evaluation:
    """Score ``codebook`` on the labelled test images of ``folder`` (matched by class key)."""
    images = LabelledImages(folder, backbones)
    model = codebook_model(codebook, backbones)
    steps = class_steps(codebook)
    names = codebook.names
    confusion = torch.zeros(len(names), len(names), dtype=torch.int64)
    groups = torch.tensor([steps[name] for name in names], dtype=torch.long)
    scores = images.score(model, groups, confusion)
    lacking = images.rows(names) < 0
    left_out: dict[str, int] = {}
    for label in images.test.labels[lacking].tolist():
        name = images.folder_names[images.keys[label]]
        left_out[name] = left_out.get(name, 0) + 1
    return Evaluation(names, steps, scores, confusion, left_out, images.unreadable)
