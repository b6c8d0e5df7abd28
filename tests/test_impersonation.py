"""A lone class's statistics cannot impersonate another site's class (issue 43, attack 4): after
the head's replay, ``replay.impersonations`` names a class one site alone holds whose head row
the replay moved toward the head row of a class that site does not hold."""

from __future__ import annotations

import pytest
import torch

from starfed.server.replay import first_replayed, impersonations
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.schema import ModelDims

DIMS = ModelDims(d_txt=8, d_clip=6, d_vit=64, n_layers=2)


def _replayed(merged: Codebook, name: str, change: torch.Tensor) -> Codebook:
    """``merged`` after a replay that moved ``name``'s aligned row by ``change`` from its
    trained row (the others' aligned rows are their trained rows)."""
    aligned = {
        n: {"aligned_head_weight": merged[n].tensor("head_weight") + (change if n == name else 0)}
        for n in merged.names
    }
    return merged.set_values(aligned)


@pytest.fixture
def merged(make_codebook) -> Codebook:
    return make_codebook(DIMS, n_classes=4)


@pytest.mark.adversarial
def test_a_lone_class_pulled_along_another_sites_head_is_named(merged) -> None:
    """m alone holds x; the replay moved x's row mostly along a's class's row (a small part at
    random): x is named, against a's class and with m as its site."""
    x, of_a, of_b, of_m = merged.names
    holders = {x: {"m"}, of_a: {"a"}, of_b: {"b"}, of_m: {"m", "a"}}
    noise = torch.randn(DIMS.d_vit, generator=torch.Generator().manual_seed(0))
    change = 3 * merged[of_a].tensor("head_weight") + 0.01 * noise
    found = impersonations(merged, _replayed(merged, x, change), [x], holders)
    assert [(f.name, f.site, f.other) for f in found] == [(x, "m", of_a)]
    assert found[0].cosine > 0.99
    assert "a class m does not hold" in found[0].reason


def test_a_class_its_site_holds_or_a_shared_class_is_no_impersonation(merged) -> None:
    """The same pull toward a class m holds too, or by a class two sites hold, or by a class
    not in play, is not a lone class taking another site's class."""
    x, of_a, of_b, of_m = merged.names
    toward_m = _replayed(merged, x, 3 * merged[of_m].tensor("head_weight"))
    assert impersonations(merged, toward_m, [x], {x: {"m"}, of_m: {"m", "a"}}) == []
    toward_a = _replayed(merged, x, 3 * merged[of_a].tensor("head_weight"))
    assert impersonations(merged, toward_a, [x], {x: {"m", "b"}, of_a: {"a"}}) == []
    assert impersonations(merged, toward_a, [of_b], {x: {"m"}, of_a: {"a"}}) == []


def test_an_honest_replays_change_points_at_no_class(merged) -> None:
    """A change of no particular direction (random, 100 draws) stays under the bound against
    every class; a replay that changes nothing (the first task's) names none."""
    x, *others = merged.names
    holders = {x: {"m"}, **{name: {"a"} for name in others}}
    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        change = torch.randn(DIMS.d_vit, generator=generator)
        assert impersonations(merged, _replayed(merged, x, change), [x], holders) == []
    assert impersonations(merged, merged, [x], holders) == []


@pytest.mark.adversarial
def test_a_first_step_class_is_checked_at_the_replay_that_first_moves_it(merged) -> None:
    """Issue 43, attack 4's gap: the federation's first step runs no head replay, so a lone
    class placed then is finished before any replay moved its row. The next step's replay is
    the first to use its H_c: the class is checked then, though not in play (its aligned row
    was its trained row, ``first_replayed``); a finished class a replay has moved before is
    not checked again."""
    x, of_a, of_b, of_m = merged.names
    holders = {x: {"m"}, of_a: {"a"}, of_b: {"b"}, of_m: {"m", "a"}}
    step_one = merged.set_values(
        {x: {"aligned_head_weight": merged[x].tensor("head_weight")}}, freeze=[x]
    )
    assert first_replayed(step_one) == [x]
    change = 3 * merged[of_a].tensor("head_weight")
    found = impersonations(step_one, _replayed(step_one, x, change), [of_b], holders)
    assert [(f.name, f.site, f.other) for f in found] == [(x, "m", of_a)]
    replayed_before = step_one.set_values(
        {x: {"aligned_head_weight": merged[of_b].tensor("head_weight")}}
    )
    assert first_replayed(replayed_before) == []
    assert (
        impersonations(replayed_before, _replayed(replayed_before, x, change), [of_b], holders)
        == []
    )
