"""An optional test set on the server: an ImageFolder scored like one more site.

A federation needs none — sites score the codebook on their own test images — but a simulation
(or an operator with a held-out set) can give the server one (``server-test-dir``): its classes
are matched to the codebook by class key, and its scores are grouped by arrival step exactly like
the sites' (``server.scores.aggregate``), so the two can be compared.
"""

from __future__ import annotations

from pathlib import Path

import torch

from starfed.server.scores import aggregate
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.cropdiseases import DatasetError, decode_images
from starfed.shared.data.site_folder import SiteFolder, class_key
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import score_classes
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, clip_features
from starfed.shared.report import EvaluationReport


class ServerTestSet:
    """Test images of a folder of class folders, decoded and CLIP-encoded once."""

    def __init__(self, folder: str | Path, backbones: Backbones, train: TrainConfig) -> None:
        scanned = SiteFolder.scan(folder)
        if len(scanned.tasks) != 1:
            raise DatasetError(f"{folder}: the server's test set must be one folder of classes")
        classes = {class_key(n): paths for n, paths in scanned.tasks[0].train.items()}
        keys = sorted(classes)
        samples = [(p, i) for i, key in enumerate(keys) for p in classes[key]]
        self.keys = keys
        self.test = decode_images(samples, backbones.config.image_size, progress=False)
        self.features = clip_features(backbones, self.test.images)
        self.backbones, self.train = backbones, train

    def __call__(self, codebook: Codebook, class_steps: dict[str, int], step: int) -> dict:
        """Scores by arrival step of the codebook's classes on this test set."""
        row_of = {class_key(name): row for row, name in enumerate(codebook.names)}
        rows = torch.tensor([row_of.get(self.keys[int(i)], -1) for i in self.test.labels])
        known = rows >= 0
        model = StarPrompt(self.backbones, confidence_modulation=self.train.confidence_modulation)
        model.load_bank(codebook.bank())
        groups = torch.tensor([class_steps[name] for name in codebook.names])
        scores = score_classes(
            model, self.test.images[known], rows[known], self.features[known], groups
        )
        report = EvaluationReport.of(codebook, scores)
        result = aggregate([("server", report)], class_steps, step, codebook.dims.n_layers)
        return {"accuracy": result.accuracy, "selection_accuracy": result.selection_accuracy}
