"""Per-class diagonal Mixtures of Gaussians: the generative-replay memory of both levels.

STAR-Prompt keeps, for every class, a mixture over CLIP image features (first level, G_c) and
one over the ViT's final-LN CLS features (second level, H_c), and later replays samples drawn
from them. The statistics are float64 (they are averaged across sites and tasks); samples are
float32 like the features they stand for.

Fitting uses scikit-learn's ``GaussianMixture(covariance_type="diag")`` (k-means init, reg 1e-6):
it is the reference point (docs/model.md), and it avoids the reference implementation's E-step bug
(σ used where σ² belongs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_COMPONENTS = 5
DEFAULT_REG = 1e-6


@dataclass(frozen=True)
class GaussianMixture:
    """A diagonal-covariance mixture fitted on ``count`` feature vectors of one class."""

    weights: torch.Tensor  # [M] float64, sums to 1
    means: torch.Tensor  # [M, D] float64
    variances: torch.Tensor  # [M, D] float64, > 0
    count: int  # number of feature vectors the statistics summarise

    @property
    def n_components(self) -> int:
        return int(self.weights.shape[0])

    @property
    def dim(self) -> int:
        return int(self.means.shape[1])

    @classmethod
    def fit(
        cls,
        features: torch.Tensor,
        n_components: int = DEFAULT_COMPONENTS,
        seed: int = 0,
        reg: float = DEFAULT_REG,
        max_iter: int = 100,
    ) -> GaussianMixture:
        """Fit by EM. ``n_components=1`` is the paper's "unimodal" ablation (one Gaussian).

        With fewer vectors than components, the number of components shrinks to the number of
        vectors, so a site holding only a few images of a class still contributes statistics.
        """
        x = features.detach().to("cpu", torch.float64).numpy()
        if x.ndim != 2 or x.shape[0] == 0:
            raise ValueError(f"need a non-empty [N, D] feature matrix, got shape {tuple(x.shape)}")
        if not np.isfinite(x).all():
            raise ValueError("features contain NaN or infinite values")
        m = max(1, min(n_components, x.shape[0]))
        if x.shape[0] == 1:
            # EM is undefined for one point: a point mass widened by the regulariser.
            return cls(
                weights=torch.ones(1, dtype=torch.float64),
                means=torch.from_numpy(x.copy()),
                variances=torch.full_like(torch.from_numpy(x), reg),
                count=1,
            )
        # sklearn only here: importing it costs every reader of a codebook 2 s (issue 34)
        from sklearn.mixture import GaussianMixture as SkGaussianMixture

        sk = SkGaussianMixture(
            n_components=m,
            covariance_type="diag",
            reg_covar=reg,
            init_params="kmeans",
            max_iter=max_iter,
            random_state=seed,
        ).fit(x)
        return cls(
            weights=torch.from_numpy(sk.weights_.astype(np.float64)),
            means=torch.from_numpy(sk.means_.astype(np.float64)),
            variances=torch.from_numpy(sk.covariances_.astype(np.float64)),
            count=int(x.shape[0]),
        )

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw ``n`` float32 feature vectors (component by weight, then Gaussian noise)."""
        component = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        noise = torch.randn(n, self.dim, dtype=torch.float64, generator=generator)
        samples = self.means[component] + noise * self.variances[component].sqrt()
        return samples.to(torch.float32)

    def mean(self) -> torch.Tensor:
        """Overall mean of the mixture, [D]."""
        return self.weights @ self.means

    def deviation(self) -> torch.Tensor:
        """√(E‖x − mean‖²): the spread of the features the mixture summarises (a scalar)."""
        offsets = (self.means - self.mean()) ** 2 + self.variances
        return (self.weights @ offsets).sum().sqrt()


@dataclass(frozen=True)
class MixtureStack:
    """The mixtures of many classes as stacked float32 tensors on one device, so a batch of
    samples of any classes is one draw: the bounded replay's memory (``shared/model/replay.py``).
    Mixtures with fewer components are padded with components of weight 0."""

    weights: torch.Tensor  # [C, M]
    means: torch.Tensor  # [C, M, D]
    stds: torch.Tensor  # [C, M, D]

    @classmethod
    def of(cls, mixtures: list[GaussianMixture], device: torch.device) -> MixtureStack:
        m = max(mixture.n_components for mixture in mixtures)

        def stacked(field: str) -> torch.Tensor:
            rows = [getattr(mixture, field) for mixture in mixtures]
            padded = [torch.cat([r, r.new_zeros(m - len(r), *r.shape[1:])]) for r in rows]
            return torch.stack(padded).to(device, torch.float32)

        variances = stacked("variances")
        return cls(stacked("weights"), stacked("means"), variances.clamp_min(0).sqrt())

    def __len__(self) -> int:
        return int(self.weights.shape[0])

    def sample(self, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One float32 feature vector per label (a class row), drawn on the stack's device with
        ``generator`` (a generator of that device)."""
        component = torch.multinomial(self.weights[labels], 1, generator=generator).squeeze(1)
        noise = torch.randn(
            len(labels), self.means.shape[2], generator=generator, device=self.means.device
        )
        return self.means[labels, component] + noise * self.stds[labels, component]


def sample_replay_features(
    mixtures: list[GaussianMixture], n_per_class: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic features for every class of ``mixtures`` (label = position in the list)."""
    features = torch.cat([m.sample(n_per_class, generator) for m in mixtures])
    labels = torch.arange(len(mixtures)).repeat_interleave(n_per_class)
    return features, labels
