"""Issue 34's real step at a toy size: ``bench/big_step.py`` as CI can afford it.

The bench runs one step of a federation of N paper-dims classes through the real apps on the
local runtime: five sites holding the codebook bring four classes each, and a sixth, holding
nothing, joins and must end the step with the server's codebook. Here the same functions run
at the tiny preset with the part size made small, so that the sixth site is caught up in
several parts and the others, one step behind, get deltas only.
"""

from __future__ import annotations

import sys
from pathlib import Path

from starfed.server.federation import Federation
from starfed.shared.codebook import parts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import big_step

CLASSES = 60


def test_a_site_joining_a_federation_is_caught_up_in_parts_through_the_real_apps(
    tmp_path: Path, one_torch_thread: None
) -> None:
    prepared = big_step.prepare(tmp_path, CLASSES, "tiny")
    assert prepared["codebook_version"] == 1
    founded = Federation.open(tmp_path / "server" / "federation").checkpoints.codebook()
    # half the founding codebook: the 20 new classes' delta fits one part, the whole does not
    got = big_step.step(tmp_path, "tiny", parts.broadcast_bytes(founded, 0, "float32") // 2)

    assert got["status"] == "completed", got
    assert got["classes_after"] == CLASSES + big_step.SITES * big_step.NEW_CLASSES
    assert got["caught_up_sites"] == [big_step.JOINING]
    assert got["joining_catch_up_parts"] >= 3  # 80 classes in parts of 30 classes' bytes
    assert all(status.endswith(":ok") for status in got["joining_statuses"])
    assert got["joining_holds_the_codebook"]
    # what the server wrote is the federation folder's (and the ClientApp calls are not in it)
    assert 0 < got["of_which_metrics_and_plots"] < got["server_bytes_written"]
    assert got["clients_bytes_written"] > 0
