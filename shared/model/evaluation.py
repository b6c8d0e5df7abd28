"""Per-task test accuracy and prompt-selection accuracy of a model on a labelled test set."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starfed.shared.data.cropdiseases import DecodedImages, SplitCropDiseases, to_unit
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import EVAL_BATCH_SIZE, Views


@dataclass
class TaskScores:
    accuracy: list[float]  # % correct per task
    selection_accuracy: list[float]  # % of (image, block) choices whose key is of the image's task


@torch.no_grad()
def evaluate_tasks(
    model: StarPrompt,
    images: torch.Tensor,
    labels: torch.Tensor,
    image_features: torch.Tensor,
    task_of_row: torch.Tensor,
    n_tasks: int,
    use_keys: bool = False,
) -> TaskScores:
    """Accuracy over all bank classes, split by the task of each test image.

    ``labels`` are bank rows; ``task_of_row[r]`` is the task that introduced row r; the test
    set covers tasks ``0 .. n_tasks-1``. Prediction is class-incremental: no task id is given.
    """
    if len(labels) == 0:  # e.g. a site holding no test images of its classes
        return TaskScores([float("nan")] * n_tasks, [float("nan")] * n_tasks)
    views = Views.of(model.backbones)
    correct, selected_ok = [], []
    for i in range(0, len(labels), EVAL_BATCH_SIZE):
        chunk = slice(i, i + EVAL_BATCH_SIZE)
        vit_in, _ = views.pair(to_unit(images[chunk]))
        prediction = model.predict(vit_in, image_features[chunk], use_keys=use_keys)
        target = labels[chunk]
        correct.append(prediction.logits.argmax(-1) == target)
        selected_ok.append(
            (task_of_row[prediction.selected] == task_of_row[target][:, None]).float().mean(1)
        )
    hits, selection = torch.cat(correct).float(), torch.cat(selected_ok)
    tasks = task_of_row[labels]
    accuracy, selection_accuracy = [], []
    for t in range(n_tasks):
        mask = tasks == t
        accuracy.append(100.0 * float(hits[mask].mean()) if mask.any() else float("nan"))
        selection_accuracy.append(
            100.0 * float(selection[mask].mean()) if mask.any() else float("nan")
        )
    return TaskScores(accuracy, selection_accuracy)


def evaluate_decoded(
    model: StarPrompt,
    test: DecodedImages,
    image_features: torch.Tensor,
    split: SplitCropDiseases,
    n_tasks: int,
    use_keys: bool = False,
) -> TaskScores:
    """``evaluate_tasks`` on decoded test images labelled with the split's global labels.

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
    return evaluate_tasks(
        model,
        test.images[known],
        rows[known],
        image_features[known],
        task_of_row,
        n_tasks,
        use_keys=use_keys,
    )
