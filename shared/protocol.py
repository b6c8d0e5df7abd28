"""The federated protocol as one table: a step's sync, then its codebook phases, in order.

A step starts with the sync (``SYNC``, the ``query.sync`` message): every connected
site says which classes its current task brings, with their image counts, and which codebook
version it holds — names and counts only, no codebook either way (the step before's evaluation,
travelling with it, brings the codebook to the sites that evaluate it). The server registers the new
classes, then sends each codebook phase of ``PHASES`` to the synced sites in turn (the two
training phases ``stage1-rounds`` and ``stage2-rounds`` times). For every message the table says
which Flower message type carries it, whether it carries the codebook, what a site returns and
which random streams the work draws from. ``MESSAGES`` is every message a site answers (the
ClientApp registers a handler for each); how the server reduces the replies of a phase is its
strategy's (``starfed.server.strategy``). docs/design.md#the-protocol shows the table.

A phase that needs nothing the phase before it produced travels with that phase's last round
(``travels_with``): the message's config names it (``TRAVELLING``) and the site adds its update to
the same reply, so the step costs one message less — each message waits for a deployed site's
SuperNode to ask for work, every 3 s when idle (docs/benchmarks.md). The stage-1 statistics
depend only on the frozen CLIP image features; they are sent on their own only when the step
resumes after stage 1 was checkpointed without them. The evaluation travels with the sync — the
*next* step's: that sync carries the codebook the step ended with to the sites that evaluate it,
and their reports come back beside their sync updates; the run's last step (``--steps``,
``max-steps``) evaluates in a message of its own.
The stage-2 statistics cannot travel with stage 2: a site fits H_c on ViT features prompted by
every bank class's A and Q as stage 2 *merged* them (its own classes' over their holders, other
sites' classes in play), which the stage-2 message does not carry — travelling, they would be
fitted on the values before stage 2 and change every later codebook value.

Random streams are named so that a single site (``starfed train-local``) and a federation draw
the same numbers for the same work (``starfed.shared.model.training.phase_generator``); the names
are part of what makes results reproducible, so they never change.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from starfed.proto import codebook_pb2 as pb


class Phase(enum.IntEnum):
    """A message of an aggregation step; the values are the protobuf ``Phase`` numbers."""

    SYNC = pb.PHASE_SYNC  # the sync
    STAGE1 = pb.PHASE_STAGE1
    STAGE1_STATS = pb.PHASE_STAGE1_STATS
    STAGE2 = pb.PHASE_STAGE2
    STAGE2_STATS = pb.PHASE_STAGE2_STATS
    EVALUATE = pb.PHASE_EVALUATE

    @property
    def key(self) -> str:
        """The phase's one spelling in logs, metrics and checkpoints (``stage1_stats``)."""
        return self.name.lower()


@dataclass(frozen=True)
class PhaseSpec:
    """One row of the protocol table."""

    phase: Phase
    message_type: str  # Flower message type ("<train|query|evaluate>[.<action>]")
    sends_codebook: bool  # the message carries the codebook (without mixtures)
    returns: str  # what a site returns
    site_stream: str | None  # random stream of the site's work
    server_stream: str | None  # random stream of the server's reduction (its replay)
    travels_with: Phase | None = None  # answered in the reply to this phase's last round


UPDATE = "an update: its classes with the fields the phase trains (codebook schema)"

SYNC = PhaseSpec(
    Phase.SYNC,
    "query.sync",
    False,
    "an update: the classes of its current task with their image counts (names and counts "
    "only), the codebook version it holds and, in its metadata, its site name and test images",
    None,
    None,
)

PHASES: tuple[PhaseSpec, ...] = (
    PhaseSpec(Phase.STAGE1, "train.stage1", True, UPDATE, "stage1", None),
    PhaseSpec(
        Phase.STAGE1_STATS,
        "query.stage1_stats",
        True,
        UPDATE,
        None,
        "replay1",
        travels_with=Phase.STAGE1,
    ),
    PhaseSpec(Phase.STAGE2, "train.stage2", True, UPDATE, "stage2", None),
    PhaseSpec(Phase.STAGE2_STATS, "query.stage2_stats", True, UPDATE, "stage2_stats", "replay2"),
    PhaseSpec(
        Phase.EVALUATE,
        "evaluate",
        True,
        "metrics: accuracy on its own test images",
        None,
        None,
        travels_with=Phase.SYNC,  # the next step's
    ),
)

#: Every message a site answers: the sync, then the codebook phases.
MESSAGES: tuple[PhaseSpec, ...] = (SYNC, *PHASES)

SPECS: dict[Phase, PhaseSpec] = {spec.phase: spec for spec in MESSAGES}

#: The phases that return statistics: the server merges them, then replays; a private site
#: releases them per class (its other updates are one release over all its classes).
STATISTICS = (Phase.STAGE1_STATS, Phase.STAGE2_STATS)

#: A message config's value: what Flower's ``ConfigRecord`` holds and both sides read.
ConfigValue = bool | int | float | str | list[int] | list[str]

#: Message config keys of every message, read by the site (``starfed.client.answer``): the
#: step, the round of its phase (a catch-up's part), and the dtype of the tensors sent.
STEP = "step"
ROUND = "round"
WIRE_DTYPE = "wire-dtype"
#: Sync-message config key: the classes the federation has frozen; a site brings
#: them again as names only.
FROZEN = "frozen"
#: Evaluate-message config key (and a sync's the evaluation travels with): the step that
#: registered each class, in the codebook's order.
CLASS_STEPS = "class-steps"

#: The key of the bytes in every record of a message or reply (each a ConfigRecord).
RECORD_DATA = "data"
#: Message records: the message's config (the keys below) and the codebook (or the part of
#: one) it sends, serialised.
CONFIG_RECORD = "config"
CODEBOOK_RECORD = "codebook"
#: Reply records: a phase's update (a serialised ``ClientUpdate``; for the sync, the classes it
#: brings) and an evaluation's report (a serialised ``EvaluationReport``; one that travelled with
#: a sync is in the record named after the phase's key, as every travelling phase's update).
UPDATE_RECORD = "update"
REPORT_RECORD = "report"
#: Reply record, in place of a travelling evaluation's report: the site's policy refused to
#: release it, and why (UTF-8, ``POLICY_REFUSED`` first), while the sync it travelled with is
#: answered.
EVALUATION_REFUSED = "evaluate-refused"
#: Sync-update metadata keys: the name the site gives itself, its current task ("" when it
#: brings nothing new) and the test images it holds (ASCII digits: what the server bounds its
#: evaluation reports by, ``starfed.server.screening``). A report's metadata names its site too.
SITE = "site"
TASK = "task"
TEST_IMAGES = "test-images"

#: Message config key: the keys of the phases that travel with this message (``travels_with``),
#: whose updates its reply carries, each in a record named after its phase key (the message's own
#: update is ``UPDATE_RECORD``). The key is spelt "also" on the wire, as sites of earlier releases
#: read it: the wire has no version to tell them a new spelling.
TRAVELLING = "also"

#: The message of a catch-up part (``starfed.server.catch_up``): one part of a codebook too large
#: for one message (``starfed.shared.codebook.parts``), staged by the site, which replies with
#: ``HELD``. Not a phase: it asks for no update, and a site answers it apart from them.
CATCH_UP_MESSAGE = "query.catch_up"
#: Catch-up-message config key: [the part's index, the number of parts, the classes of the whole
#: codebook].
CATCH_UP = "catch-up"
#: Catch-up-message config keys of a catch-up's first message: the manifest, every part's key and
#: version in order (``starfed.shared.codebook.parts.Plan``).
CATCH_UP_PARTS = "catch-up-parts"
CATCH_UP_VERSIONS = "catch-up-versions"
#: Catch-up-message config key of a change of staged parts (a delta of their classes): their
#: indices.
CATCH_UP_PATCHED = "catch-up-patched"
#: Reply record of a catch-up part: the codebook version the site holds after it (ASCII
#: digits), 0 until every part is staged and the assembled codebook passed its checks.
HELD = "held"
#: Reply record of a catch-up part: the version each part of the manifest is staged at
#: (``Staging.versions``); the server sends only what changed since, and trusts it for nothing
#: else.
STAGED = "staged"
#: The key a catch-up's exchanges are recorded under (the step's exchanges, logs, the site's
#: release record), as a phase's are under its key.
CATCH_UP_KEY = "catch_up"

#: Evaluate-message config key: predict with the first-level keys alone (the keys ablation,
#: ``starfed.simulations.methods.keys``); absent means the full two-level prediction.
CLASSIFY_WITH_KEYS = "classify-with-keys"

#: Update-metadata keys of a site with the privacy setting (``starfed.client.privacy``): its ε
#: so far for one training image, and the classes it refused to share because their privacy
#: budget is exhausted (comma-separated; the server records a refusal, not a failure).
PRIVACY_EPSILON = "privacy-epsilon"
BUDGET_EXHAUSTED = "privacy-budget-exhausted"

#: How a site's error reply begins when its policy refused the message (``starfed.client.policy``):
#: the server records a refusal by the site's policy, with the reason after it, not a failure.
POLICY_REFUSED = "refused by the site's policy"


def reply_sha256(records: Iterable[tuple[str, bytes]]) -> str:
    """The sha256 of a reply's bytes: its records' data in the order of their names (one
    record: the sha256 of its bytes). The site's release record and the server's history both
    keep it, so they can be compared (docs/security.md#the-release-record)."""
    digest = hashlib.sha256()
    for _, data in sorted(records, key=lambda record: record[0]):
        digest.update(data)
    return digest.hexdigest()


# --- what a message's records hold, typed (Flower types a record value as any of its kinds) --


def record_bytes(value: object, what: str) -> bytes:
    """A record's ``data``: the bytes of a codebook, an update or a report; ``TypeError`` for a
    malformed message."""
    if not isinstance(value, bytes):
        raise TypeError(f"{what}: expected bytes, got {type(value).__name__}")
    return value


def record_int(value: object, what: str) -> int:
    """A message config's integer (``step``, ``round``); ``TypeError`` for a malformed one."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{what}: expected an integer, got {type(value).__name__}")
    return int(value)
