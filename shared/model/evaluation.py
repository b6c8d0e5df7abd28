"""Test accuracy and prompt-selection accuracy: per class, then per group of classes.

Scores are counted per class first (``score_classes``), because a federation adds up the counts
its sites report for the classes they hold; a group of classes (a task of the split, or the
classes a federation step registered) is then scored from the counts of its classes
(``group_scores``). Prediction is class-incremental: no task id is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starfed.shared.data.cropdiseases import SplitCropDiseases
from starfed.shared.data.images import DecodedImages, device_batches, to_unit
from starfed.shared.model.features import EVAL_BATCH_SIZE, Views
from starfed.shared.model.star_prompt import StarPrompt


@dataclass
class ClassScores:
    """Counts per bank row: test images, correct predictions, and prompt selections whose key
    belongs to the image class's group, out of ``selections`` (images × blocks); and the wrong
    predictions by pair, sparse (a dense true × predicted matrix is 800 MB at 10,000 classes,
    the pairs are at most the test images)."""

    images: torch.Tensor  # int64 [C]
    correct: torch.Tensor  # int64 [C]
    selection_hits: torch.Tensor  # int64 [C]
    selections: torch.Tensor  # int64 [C]
    mistaken: torch.Tensor  # int64 [K, 3]: true row, predicted row, images; each pair once


@dataclass
class TaskScores:
    accuracy: list[float]  # % correct per group
    selection_accuracy: list[float]  # % of (image, block) choices whose key is of the group


@torch.no_grad()
def score_classes(
    model: StarPrompt,
    images: torch.Tensor,
    rows: torch.Tensor,
    image_features: torch.Tensor,
    group_of_row: torch.Tensor,
    use_keys: bool = False,
    confusion: torch.Tensor | None = None,
) -> ClassScores:
    """Count, per bank row, how its test images (``rows`` are their true rows) are predicted;
    ``confusion`` (int64 ``[C, C]``, true row × predicted row) is added to when given."""
    n, device = len(model.bank), model.device
    counts = [torch.zeros(n, dtype=torch.int64, device=device) for _ in range(4)]
    images_, correct, hits, selections = counts  # counted on the device, read once at the end
    groups = group_of_row.to(device)
    pairs = None if confusion is None else torch.zeros_like(confusion, device=device)
    wrong_pairs = []  # true row × n + predicted row of each wrong prediction
    views = Views.of(model.backbones)
    batches = device_batches(images, EVAL_BATCH_SIZE, device)
    for i, batch in zip(range(0, len(rows), EVAL_BATCH_SIZE), batches, strict=True):
        chunk = slice(i, i + EVAL_BATCH_SIZE)
        vit_in, _ = views.pair(to_unit(batch))
        prediction = model.predict(vit_in, image_features[chunk], use_keys=use_keys)
        target = rows[chunk].to(device)
        predicted = prediction.logits.argmax(-1)
        same_group = groups[prediction.selected] == groups[target][:, None]
        images_.index_add_(0, target, torch.ones_like(target))
        correct.index_add_(0, target, (predicted == target).long())
        hits.index_add_(0, target, same_group.sum(1))
        selections.index_add_(0, target, torch.full_like(target, same_group.shape[1]))
        wrong = predicted != target
        wrong_pairs.append(target[wrong] * n + predicted[wrong])
        if pairs is not None:
            pairs.index_put_((target, predicted), torch.ones_like(target), accumulate=True)
    if confusion is not None and pairs is not None:  # pairs: counted when confusion is asked
        confusion += pairs.cpu()
    none = torch.zeros(0, dtype=torch.int64, device=device)
    codes, times = torch.unique(torch.cat([none, *wrong_pairs]), return_counts=True)
    mistaken = torch.stack([codes // n, codes % n, times]).T.cpu()
    images_, correct, hits, selections = (count.cpu() for count in counts)
    return ClassScores(images_, correct, hits, selections, mistaken)


def group_scores(scores: ClassScores, group_of_row: torch.Tensor, n_groups: int) -> TaskScores:
    """Accuracy of each group ``0 .. n_groups-1`` over the test images of its classes (NaN for
    a group without test images)."""
    accuracy, selection = [], []
    for group in range(n_groups):
        mask = group_of_row == group
        images, correct = int(scores.images[mask].sum()), int(scores.correct[mask].sum())
        selections = int(scores.selections[mask].sum())
        hits = int(scores.selection_hits[mask].sum())
        accuracy.append(100.0 * correct / images if images else float("nan"))
        selection.append(100.0 * hits / selections if selections else float("nan"))
    return TaskScores(accuracy, selection)


def evaluate_decoded(
    model: StarPrompt,
    test: DecodedImages,
    image_features: torch.Tensor,
    split: SplitCropDiseases,
    n_tasks: int,
    use_keys: bool = False,
) -> TaskScores:
    """Scores per task of the split, on decoded test images labelled with its global labels.

    ``image_features`` are the CLIP features of ``test.images`` (``clip_features``; frozen, so
    a caller evaluating the same images repeatedly computes them once). Bank rows are matched
    to the split by class name, so the bank may be in any order (a codebook's). Images of
    classes the bank does not hold (not learned yet, or no site could register them) are left
    out.
    """
    row_of = {name: row for row, name in enumerate(model.bank.names)}
    folders = split.class_folders
    rows = torch.tensor([row_of.get(folders[int(label)], -1) for label in test.labels])
    task_of_row = torch.tensor([split.task_of_label(folders.index(n)) for n in model.bank.names])
    known = rows >= 0
    scores = score_classes(
        model, test.images[known], rows[known], image_features[known], task_of_row, use_keys
    )
    return group_scores(scores, task_of_row, n_tasks)
