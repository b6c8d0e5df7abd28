"""docs/design.md shows the schema and the protocol as the code defines them."""

from __future__ import annotations

from pathlib import Path

from starfed.client.site import HANDLERS
from starfed.server.coordinator import REDUCERS
from starfed.shared.codebook import schema
from starfed.shared.protocol import PHASES, Phase

DESIGN = (Path(__file__).parent.parent / "docs" / "design.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """Cells of the first table after ``heading``, header and rule excluded."""
    rows: list[list[str]] = []
    for line in DESIGN.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip(" `") for cell in line.strip("|").split("|")])
        elif rows:
            break
    assert rows, heading
    return rows[2:]


def test_schema_table_matches_the_schema() -> None:
    rows = [row for row in table_rows("## The codebook") if row[0] in schema.BY_NAME]
    assert [row[0] for row in rows] == [f.name for f in schema.FIELDS]
    for row, field in zip(rows, schema.FIELDS, strict=True):
        assert row[1] == field.symbol
        carried = field.trained_in.key if field.trained_in else "(server"
        assert row[3].startswith(carried), field.name
        assert row[4] == ("yes" if field.broadcast else "no")


def test_protocol_table_matches_the_protocol() -> None:
    rows = table_rows("## The protocol")
    assert [row[0] for row in rows] == [spec.phase.key for spec in PHASES]
    for row, spec in zip(rows, PHASES, strict=True):
        assert row[1] == spec.message_type
        assert row[2] == ("codebook" if spec.sends_codebook else "nothing")
        if spec.site_stream:
            assert row[5] == spec.site_stream
        assert row[7] == (spec.server_stream or "—")
    # every training or statistics phase has a site handler, every phase a server reducer
    assert set(REDUCERS) == set(Phase)
    assert set(HANDLERS) == {Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS}
