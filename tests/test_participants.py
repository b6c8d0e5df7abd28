"""Who takes part in a round (``server.participants.Participants``): a seeded share of the sites,
drawn over their names, that never leaves a class in play without an update."""

from __future__ import annotations

from dataclasses import replace

from starfed.server.participants import Participants
from starfed.shared.config import ProtocolOptions, parse
from starfed.shared.data.site_folder import class_key
from starfed.shared.protocol import Phase

SITES = [f"farm-{letter}" for letter in "abcdefghij"]


def _participants(first_node: int) -> Participants:
    """Ten sites under node ids that start at ``first_node``; only the last brings "Rare"."""
    nodes = list(range(first_node, first_node + len(SITES)))
    sites = dict(zip(nodes, SITES, strict=True))
    brings = {node: {class_key("Common")} for node in nodes}
    brings[nodes[-1]] |= {class_key("Rare")}
    return Participants(node_ids=nodes, sites=sites, brings=brings)


def test_sample_is_a_seeded_share_by_site_name_with_every_class_held() -> None:
    protocol = replace(
        ProtocolOptions.from_config(parse({})), fraction_train=0.2, min_train_sites=1
    )
    one, other = _participants(100), _participants(7000)
    for round_index in range(4):
        chosen = one.sample(Phase.STAGE1, 3, round_index, ("Common", "Rare"), protocol, 1993)
        again = other.sample(Phase.STAGE1, 3, round_index, ("Common", "Rare"), protocol, 1993)
        names = {one.sites[node] for node in chosen}
        assert names == {other.sites[node] for node in again}  # node ids change, names do not
        assert "farm-j" in names  # the only holder of "Rare", added when the draw missed it
        assert 2 <= len(names) <= 3  # ⌈0.2 · 10⌉ drawn, plus at most that holder
    # the sync and the evaluation go to every participant
    every = one.sample(Phase.EVALUATE, 3, 0, ("Common", "Rare"), protocol, 1993)
    assert every == one.node_ids


def test_quarantined_sites_leave_and_versions_are_noted() -> None:
    participants = _participants(1)
    participants.leave({"farm-c"})
    assert 3 not in participants.node_ids and len(participants.node_ids) == len(SITES) - 1
    participants.set_version(4, 7)
    assert participants.versions == {4: 7}
    participants.set_version(4, None)  # unknown: the whole codebook next
    assert participants.versions == {}
