"""The server's side of a step as pure functions: codebook in, new codebook out.

The server holds the mixtures of every class, so it runs both generative replays
(``starfed.shared.model.training.replay1``/``replay2``) and registers new classes with their
deterministic initial values. Each function builds a throw-away model from the codebook, runs
the same step a single site runs, and returns the codebook with the changed values, so the
codebook stays the server's single source of truth. After the head's replay, ``impersonations``
names a class that one site alone holds whose replayed head row moved toward another site's
class (docs/security.md, §1c, attack 4).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from starfed.shared.codebook.codebook import Codebook
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, replay1, replay2


def _past_prefix(codebook: Codebook) -> int:
    """How many classes are frozen; they must come first (classes are appended and a step
    freezes all its classes or, if it fails, is rolled back), as both replays assume."""
    n_past = len(codebook.frozen)
    if not all(codebook[name].frozen for name in codebook.names[:n_past]):
        raise ValueError("frozen classes must precede the classes in play")
    return n_past


def register(
    codebook: Codebook, names: list[str], backbones: Backbones, config: TrainConfig
) -> Codebook:
    """``names`` appended with the initial values every site would compute for them."""
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    return codebook.register(model.new_entries(names, seed=config.seed))


def replay_first_level(
    codebook: Codebook, backbones: Backbones, config: TrainConfig, step: int
) -> Codebook:
    """First-level replay over every class's G_c; the classes in play get their final prompts
    and keys (frozen from now on)."""
    n_past = _past_prefix(codebook)
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    model.load_bank(codebook.bank())
    replay1(model, n_past, config, step)
    current = model.bank.entries(model.bank.names[n_past:], fields=("prompt", "key"))
    return codebook.set_values({entry.name: entry.values for entry in current})


def replay_head(
    codebook: Codebook, config: TrainConfig, step: int, freeze: Iterable[str], device: torch.device
) -> Codebook:
    """The prediction head of every class re-aligned by replay on every class's H_c (on
    ``device``); the classes ``freeze`` (the step's) are finished."""
    n_past = _past_prefix(codebook)
    bank = codebook.bank().to(device)
    replay2(bank, n_past, config, step)
    aligned = bank.entries(fields=("aligned_head_weight", "aligned_head_bias"))
    return codebook.set_values({entry.name: entry.values for entry in aligned}, freeze=freeze)


#: How far the replay's change of a lone class's head row may point at the head row of a class
#: its site does not hold (cosine). Honest: at most 0.28 in the default simulation (every class
#: in play against every other), 0.18 in the attacks' clean runs; a lone class whose H_c sits
#: along another class's head: 0.90-0.99 (docs/security.md, §1c, attack 4).
IMPERSONATION_BOUND = 0.6


@dataclass(frozen=True)
class Impersonation:
    """A class one site alone holds whose head row the replay moved toward the head row of a
    class that site does not hold: its statistics (H_c) sit where that class's images lie."""

    name: str  # the lone class
    site: str  # its one holder
    other: str  # the class whose head it moved toward
    cosine: float  # of the replay's change of its row with the other's row

    @property
    def reason(self) -> str:
        return (
            f"its statistics turned its head row toward the head row of {self.other[:60]!r}, "
            f"a class {self.site} does not hold (cosine {self.cosine:.2f}, over "
            f"{IMPERSONATION_BOUND}): left out of the step"
        )


def first_replayed(merged: Codebook) -> list[str]:
    """The finished classes no head replay has moved yet: their aligned head row is still their
    trained one (the federation's first step runs none; ``replay_head`` copies the row)."""
    return [
        name
        for name, entry in merged.entries.items()
        if entry.frozen
        and "aligned_head_weight" in entry.values
        and torch.equal(entry.tensor("aligned_head_weight"), entry.tensor("head_weight"))
    ]


def impersonations(
    merged: Codebook,
    replayed: Codebook,
    in_play: Iterable[str],
    holders: Mapping[str, Collection[str]],
) -> list[Impersonation]:
    """The classes in play, and the finished ones this replay is the first to move
    (``first_replayed``: a class of the federation's first step, which runs no head replay),
    that one site alone holds (``holders``: the registry's) whose change by the head's replay,
    from their trained row in ``merged`` to their aligned row in ``replayed``, points at the
    trained head row of a class that site does not hold by more than ``IMPERSONATION_BOUND``.
    An honest class's replay moves its row toward no class in particular; one whose H_c was
    placed along another class's head is pulled along it, and then takes that class's images —
    from the first replay that uses its H_c on, so a class of the first step is checked at the
    next (issue 43, attack 4). Its cost: none in a step without a lone class to check; else
    every class's head row stacked (O(classes × d_vit): about 0.25 s and 61 MB at 10,000 classes
    of 768, CPU) and one cosine per class for each lone class, O(lone classes × classes × d_vit),
    besides the replay's O(epochs × classes × samples × classes × d_vit); ``first_replayed``
    compares each finished class's two rows, O(classes × d_vit)."""
    checked = [*first_replayed(merged), *in_play]
    lone = [name for name in checked if len(holders.get(name, ())) == 1]
    if not lone:  # the usual step: nothing to stack
        return []
    names = merged.names
    rows = torch.stack([merged[name].tensor("head_weight") for name in names]).double()
    found = []
    for name in lone:
        (site,) = holders[name]
        others = [i for i, other in enumerate(names) if site not in holders.get(other, ())]
        if not others:
            continue
        trained = merged[name].tensor("head_weight").double()
        change = replayed[name].tensor("aligned_head_weight").double() - trained
        cosines = F.cosine_similarity(change.unsqueeze(0), rows[others], dim=1)
        best = int(cosines.argmax())
        if float(cosines[best]) > IMPERSONATION_BOUND:
            found.append(Impersonation(name, site, names[others[best]], float(cosines[best])))
    return found
