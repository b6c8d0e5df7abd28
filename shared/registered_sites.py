"""The operator's registered sites as a run config carries them (``site-names``,
``site-privacy``): ``starfed server run`` writes them from ``sites.json``; the screening reads
them (``server.screening``). A run config value cannot hold quotes, so no JSON: pairs of the
SuperNode id Flower authenticated by its key and what the registration says of it.
"""

from __future__ import annotations

import math


def parse_site_names(text: str) -> dict[int, str]:
    """``site-names``: "NODE:NAME ..." — the name the operator registered each node's key
    under. ValueError if one pair is not that."""
    names = {}
    for pair in text.split():
        node, sep, name = pair.partition(":")
        if not (sep and node.isdigit() and name) or int(node) in names:
            raise ValueError(f"expected NODE:NAME pairs, one per node, not {pair[:40]!r}")
        names[int(node)] = name
    return names


def parse_site_privacy(text: str) -> dict[int, float]:
    """``site-privacy``: "NODE:EPSILON ..." — the ε each registered node declared at its
    registration (``starfed server sites add --privacy-epsilon``), by SuperNode id. ValueError
    if one pair is not that."""
    declared = {}
    for pair in text.split():
        node, sep, value = pair.partition(":")
        try:
            epsilon = float(value)
        except ValueError:
            epsilon = math.nan
        if not (sep and node.isdigit() and math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"expected NODE:EPSILON pairs (ε > 0), not {pair[:40]!r}")
        if int(node) in declared:
            raise ValueError(f"node {node} is named twice")
        declared[int(node)] = epsilon
    return declared
