"""An optional test set on the server: an ImageFolder scored like one more site.

A federation needs none — sites score the codebook on their own test images — but a simulation
(or an operator with a held-out set) can give the server one (``server-test-dir``): its classes
are matched to the codebook by class key, and its scores are grouped by arrival step exactly like
the sites' (``server.scores.aggregate``), so the two can be compared. The images are read and
scored by ``LabelledImages``, as ``starfed evaluate`` does on a device.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from starfed.server.records import StepScores
from starfed.server.scores import aggregate
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.images import skipped_files
from starfed.shared.inference.predict import LabelledImages
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import CLASSIFY_WITH_KEYS
from starfed.shared.report import EvaluationReport


class ServerTestSet:
    """Test images of a folder of class folders, decoded and CLIP-encoded once."""

    def __init__(self, folder: str | Path, backbones: Backbones, train: TrainConfig) -> None:
        self.images = LabelledImages(folder, backbones)
        if self.images.unreadable:
            warnings.warn(f"server test set: {skipped_files(self.images.unreadable)}", stacklevel=2)
        self.backbones, self.train = backbones, train

    def __call__(
        self, codebook: Codebook, class_steps: Mapping[str, int], step: int, config: Mapping
    ) -> StepScores:
        """Scores by arrival step of the codebook's classes on this test set, predicted as the
        evaluate message's ``config`` asks the sites to (``CLASSIFY_WITH_KEYS``)."""
        model = StarPrompt(self.backbones, confidence_modulation=self.train.confidence_modulation)
        model.load_bank(codebook.bank())
        groups = torch.tensor([class_steps[name] for name in codebook.names])
        use_keys = bool(config.get(CLASSIFY_WITH_KEYS, False))
        scores = self.images.score(model, groups, use_keys=use_keys)
        report = EvaluationReport.of(codebook, scores)
        return aggregate([("server", report)], class_steps, step, codebook.dims.n_layers)
