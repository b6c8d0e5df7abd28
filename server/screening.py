"""What the server believes of a site: every reply screened before the strategy sees it.

Decoding (``wire.decode_update``) proves that a reply is well formed; it says nothing about
whether its numbers are plausible. A site could claim a million examples of a class it shares
with others and so own the class's merge, send rows for classes it never said it holds, send
tensors a million times too large, or register millions of classes so that the federation's
codebook outgrows what it can store and send. The ``Screen`` of a
step holds each site to what it can show (docs/security.md):

- **at the sync** (``sync``): a site name once per step, counts a class could have, a bounded
  number of new classes per site, per step (``max-step-classes``: the server's replay trains
  them together) and in all (``max-classes``: a codebook past one message
  reaches a site in parts, ``starfed.server.catch_up``); sites the operator's quarantine names
  sit out.
- **in a codebook phase** (``PhaseScreen``, ``starfed.server.field_bounds``): the count of a
  row capped by what the site reported for that class at the sync (and, with
  ``max-class-share``, by its share of the class's sync counts); rows for classes it did not
  report rejected; a row whose change from the value the phase was sent with is beyond
  ``reference-bound`` (and ``history-bound`` × the scale of earlier steps) times its class's
  size, or — where three or more sites send the field — ``update-bound`` times the median
  change over sites, rejected; a private site's (its registration's ``site-privacy``, or the
  run's ``privacy-epsilon``, never a reply's word: a reply claiming otherwise is a finding)
  held to its release's bound (clip plus noise) instead of the scale of earlier steps;
  mixtures whose variances or means are over ``mixture-bound`` times the reference (their
  E‖x‖², every component by its weight, over it times the median norm²), whose means or E‖x‖²
  are under its inverse, or whose variances are below any fit's, rejected.
  The bounds are learned from the replies themselves, so a phase is read twice: a first pass
  measures every row, a second hands the screened updates on.
- **in the evaluation** (``report``): a report of more images than the site said at the sync
  it holds is rejected.

Every cap and rejection is a ``Finding`` in the step's record; a site with ``quarantine-after``
findings is left out of the rest of the step (and, with ``quarantine-persists``, of later
steps), and the step ends ``degraded``. Honest sites are not touched by the defaults: their
counts never exceed what they reported, and their changes stay within a small factor of the
median (the default simulation's largest ratio is in docs/security.md).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from starfed.server.change_scale import ChangeScale
from starfed.server.decode import Decoded
from starfed.server.messaging import reject
from starfed.server.quarantine import Quarantined
from starfed.server.records import (
    CONTRADICTED,
    NOTED,
    QUARANTINED,
    REJECTED,
    Exchange,
    Finding,
)
from starfed.shared import progress
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.config import Options, knob
from starfed.shared.data.site_folder import class_key
from starfed.shared.protocol import PRIVACY_EPSILON, SITE, TEST_IMAGES, Phase
from starfed.shared.registered_sites import parse_site_names, parse_site_privacy
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)

#: A finding's actions that do not count toward ``quarantine-after``: the quarantine itself, and
#: what is noted without fault (a catch-up stopped after progress, ``server.catch_up``).
UNCOUNTED = (QUARANTINED, NOTED)

#: Images of one class at one site, at most: far beyond any real site, and a sum of such counts
#: over any number of sites a federation can have stays inside the wire's 64-bit counts.
MAX_IMAGES = 2**31 - 1


@dataclass(frozen=True)
class ScreeningOptions(Options):
    """The operator's bounds on what one site can do (the ``screening`` knobs; docs/federation.md):
    how far its rows may move (the four ``*_bound``, 0: none), how much of a class that others
    hold its examples may weigh, how many classes it may bring, after how many findings it is
    left out, which names belong to which registered node, which registered nodes declared
    the privacy setting (``site-privacy``), and whether the run makes every site private
    (``privacy-epsilon``): a private site's rows carry calibrated noise."""

    update_bound: float = knob("update-bound")
    reference_bound: float = knob("reference-bound")
    history_bound: float = knob("history-bound")
    mixture_bound: float = knob("mixture-bound")
    # what fixes a private site's training release (the run's: ``client.privacy``): the bound
    # on its rows is derived from it (``server.release_bounds``)
    stage1_clip: float = knob("privacy-stage1-clip")
    stage2_clip: float = knob("privacy-stage2-clip")
    batch_size: int = knob("batch-size")
    stage1_epochs: int = knob("stage1-epochs")
    stage2_epochs: int = knob("stage2-epochs")
    privacy_delta: float = knob("privacy-delta")
    max_class_share: float = knob("max-class-share")
    quarantine_after: int = knob("quarantine-after")
    quarantine_persists: bool = knob("quarantine-persists")
    site_names: str = knob("site-names")
    max_new_classes: int = knob("max-new-classes")
    max_step_classes: int = knob("max-step-classes")
    max_classes: int = knob("max-classes")
    # whether a site's rows carry noise: its registration's word, or the run's, never a reply's
    site_privacy: str = knob("site-privacy")
    privacy_epsilon: float = knob("privacy-epsilon")
    # ``median`` (the default) also holds a shared class's mixture to its other sites'
    # (``robust.outlying_mixtures``): the robust merge's, a finding where it fails
    merge: str = knob("merge")


class Furthest(NamedTuple):
    """The kept row that went furthest in a class this step (``Screen.furthest``): its
    measure (a tensor field's change, a mixture's largest mean norm), its site and what."""

    measure: float
    site: str
    what: str


@dataclass
class Declared:
    """What one site said at the sync: images per class key, and its test images (0 when it
    did not say, or said something that is no count: its reports then count no image)."""

    counts: dict[str, int]
    test_images: int


class Screen:
    """One step's screening: what each site declared at the sync, the findings, the quarantined."""

    def __init__(self, options: ScreeningOptions, step: int, scale: ChangeScale | None = None):
        self.options = options
        self.step = step
        self.scale = scale or ChangeScale()  # of the earlier steps: no sender of this one moves it
        self.observed: dict[str, list[float]] = {}  # this step's, for ``ChangeScale.save``
        self.registered = parse_site_names(options.site_names)  # node id -> the operator's name
        self.site_privacy = parse_site_privacy(options.site_privacy)  # node id -> declared ε
        self.private_sites: set[str] = set()  # of this step's sync: registered private nodes'
        self.declared: dict[str, Declared] = {}  # site -> its sync
        self.declared_total: Counter[str] = Counter()  # class key -> its images over the syncs
        self.findings: list[Finding] = []
        self.quarantined: dict[str, str] = {}  # site -> why
        # class -> the kept row that went furthest this step: whom to name if a result is invalid
        self.furthest: dict[str, Furthest] = {}

    # --- findings -------------------------------------------------------------------------

    def restore(self, findings: Iterable[Finding]) -> None:
        """A resumed step's findings from before its interruption
        (``Federation.step_findings``): they count toward ``quarantine-after`` as if just made,
        and the quarantines among them hold."""
        for finding in findings:
            self.findings.append(finding)
            if finding.action == QUARANTINED:
                self.quarantined[finding.site] = finding.reason

    def note(
        self, site: str, phase: str, round_index: int, action: str, reason: str, name: str = ""
    ) -> None:
        """Record one finding; a site reaching ``quarantine-after`` findings (``UNCOUNTED``
        actions aside) is quarantined."""
        self.findings.append(Finding(site, phase, round_index, action, reason, name))
        logger.warning(
            "screening: %s %s of %s%s: %s",
            action,
            phase,
            site,
            f" ({name[:60]})" if name else "",
            reason,
        )
        limit = self.options.quarantine_after
        if limit and site not in self.quarantined:
            mine = sum(f.site == site and f.action not in UNCOUNTED for f in self.findings)
            if mine >= limit:
                why = f"{progress.counted(mine, 'finding')} in step {self.step + 1}"
                self.quarantined[site] = why
                self.findings.append(Finding(site, phase, round_index, QUARANTINED, why))
                logger.warning(
                    "screening: %s is quarantined for the rest of the step (%s)", site, why
                )

    # --- the sync -------------------------------------------------------------------------

    def named(self, decoded: list[Decoded]) -> list[Decoded]:
        """The decoded syncs in node order, each entry under the name its site goes by in this
        step (``name_of``: the operator's for a registered node, else the one it gives)."""
        syncs = sorted(decoded, key=lambda pair: pair[0].node_id)
        for entry, update in syncs:
            claimed = update.metadata.get(SITE) or f"node-{entry.node_id}"
            entry.site = self.name_of(entry.node_id, claimed)
        return syncs

    def name_of(self, node_id: int, claimed: str) -> str:
        """The name a node is known by in this step: the operator's for a registered node
        (``site-names``), whatever it calls itself; else the name it gives."""
        name = self.registered.get(node_id)
        if name is None:
            return claimed
        if name != claimed:
            logger.warning(
                "node %d calls itself %r; it is registered as %r: known as %r",
                node_id,
                claimed[:60],
                name,
                name,
            )
        return name

    def sync(
        self, named: list[Decoded], codebook: Codebook, quarantine: Mapping[str, Quarantined]
    ) -> list[Decoded]:
        """The syncs (``named``, by node id) that may take part: sites in the operator's
        ``quarantine``, a second node with a taken name, a node using a name registered
        to another (``site-names``), impossible counts and too many new classes are rejected
        (the site sits the step out), each with a finding."""
        kept, names = [], dict[str, int]()
        registered_names = set(self.registered.values())
        for entry, update in named:
            site = entry.site
            # a name that is not the node's: its finding must not count against the name's site
            borrowed = site in names or (
                site in registered_names and self.registered.get(entry.node_id) != site
            )
            problem = None
            if site in quarantine:
                problem = quarantine[site].line()
            elif site in names:
                problem = f"site name {site!r} is taken in this step by node {names[site]}"
            elif borrowed:
                problem = f"site name {site!r} is registered to another node (site-names)"
            else:
                over = next((e for e in update.entries if e.count > MAX_IMAGES), None)
                if over is not None:
                    problem = f"claims {over.count} images of one class (at most {MAX_IMAGES})"
            if problem:
                self._reject(entry, problem, f"node-{entry.node_id}" if borrowed else site)
                continue
            names[site] = entry.node_id
            kept.append((entry, update))
        return self._bound_registration(kept, codebook)

    def _bound_registration(self, accepted: list, codebook: Codebook) -> list:
        """Sites whose new classes exceed ``max-new-classes``, then — the largest bringers
        first — those whose new classes would take the step past ``max-step-classes`` (the
        server's replay trains a step's classes together: its cost grows with their square)
        or the federation past ``max-classes``, are rejected. A codebook past one message's
        limit is no bound: it reaches a site in parts (``starfed.server.catch_up``)."""
        known = {class_key(name) for name in codebook.names}
        limit = self.options.max_classes
        brings: dict[int, set[str]] = {}
        kept = []
        for entry, update in accepted:
            new = {class_key(e.name) for e in update.entries} - known
            if len(new) > self.options.max_new_classes:
                self._reject(
                    entry,
                    f"brings {len(new)} new classes, at most "
                    f"{self.options.max_new_classes} per site and step (max-new-classes)",
                )
                continue
            brings[entry.node_id] = new
            kept.append((entry, update))
        step_limit = self.options.max_step_classes
        kept = self._shed(
            kept,
            brings,
            lambda new: len(new) <= step_limit,
            f"the step past {step_limit} new classes (max-step-classes: the server's replay "
            "trains a step's classes together)",
        )
        kept = self._shed(
            kept,
            brings,
            lambda new: len(known | new) <= limit,
            f"the federation past {limit} classes (max-classes)",
        )
        for entry, update in kept:
            if entry.node_id in self.site_privacy:
                self.private_sites.add(entry.site)
            # a private site with nothing to bring says nothing of its privacy at the sync
            self.privacy_claim(entry.site, entry.phase, entry.round, update.metadata, False)
            raw = update.metadata.get(TEST_IMAGES, "")
            test = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else 0
            counts = {class_key(e.name): e.count for e in update.entries}
            self.declared[entry.site] = Declared(counts, test)
        self.declared_total = Counter()
        for declared in self.declared.values():
            self.declared_total.update(declared.counts)
        return kept

    def _shed(
        self,
        kept: list[Decoded],
        brings: dict[int, set[str]],
        fits: Callable[[set[str]], bool],
        past: str,
    ) -> list[Decoded]:
        """``kept`` without the sites, the largest bringers first (``brings``: node -> its new
        class keys; each one rejected is taken out of it), whose new classes keep all of them
        from fitting: one site's registrations cannot crowd out the others'."""
        while not fits(set().union(*brings.values())):
            node = max(brings, key=lambda n: (len(brings[n]), n))
            entry = next(e for e, _ in kept if e.node_id == node)
            self._reject(entry, f"its {len(brings.pop(node))} new classes would take {past}")
            kept = [(e, u) for e, u in kept if e.node_id != node]
        return kept

    def _reject(self, entry, reason: str, site: str | None = None) -> None:
        reject(entry, reason)
        self.note(site or entry.site, entry.phase, entry.round, REJECTED, reason)

    # --- codebook phases ------------------------------------------------------------------

    def private(self, site: str) -> bool:
        """Whether ``site``'s rows carry its privacy mechanism's noise: the run makes every
        site private (``privacy-epsilon``), or its node declared the setting at its
        registration (``site-privacy``). Never a reply's word: a key in its metadata would
        lift its own bound (issue 43, attack 2)."""
        return self.options.privacy_epsilon > 0 or site in self.private_sites

    def privacy_claim(
        self,
        site: str,
        phase: str,
        round_index: int,
        metadata: Mapping[str, str],
        required: bool = True,
    ) -> None:
        """A reply whose privacy key (``privacy-epsilon``) says otherwise than the site's
        registration (or the run) is a finding that changes nothing (issue 43, attack 2): the
        key from a site that is not private; with ``required``, no key from one that is."""
        private, claims = self.private(site), PRIVACY_EPSILON in metadata
        if claims == private or (private and not required):
            return
        said = (
            "lacks the privacy key; the site is registered private"
            if private
            else "claims privacy (privacy-epsilon); the site is not registered private"
        )
        self.note(site, phase, round_index, CONTRADICTED, f"its reply {said}: held as registered")

    def caps(self, site: str) -> dict[str, int]:
        """The count each class of ``site`` may carry: what it reported at the sync, and with
        ``max-class-share`` < 1 at most that share of the class's sync counts over sites
        (the others' from the sync's totals: a phase costs one pass over each site's classes,
        not over every site's per site)."""
        mine = self.declared.get(site, Declared({}, 0)).counts
        share = self.options.max_class_share
        caps = dict(mine)
        if share < 1:
            for key, count in mine.items():
                others = self.declared_total[key] - count
                if others:  # share x of the total: others * x / (1 - x), rounding forgiven
                    bound = math.floor(share / (1 - share) * others + 1e-9)
                    caps[key] = min(count, max(1, bound))
        return caps

    def max_entries(self, phase: Phase, codebook: Codebook) -> int:
        """The entries a reply may carry, counted before it is parsed (``wire.check_parts``):
        in a codebook phase, the classes of the codebook it answers (a site can name no other;
        rows of classes it did not report at the sync are each a finding, ``PhaseScreen``); at
        the sync, the classes known and as many new ones as the federation may take and more
        (the sync's own checks then name what is wrong: max-new-classes, max-classes)."""
        if phase is Phase.SYNC:
            return len(codebook) + self.options.max_classes + self.options.max_new_classes
        return len(codebook)

    # --- the evaluation -------------------------------------------------------------------

    def reports(
        self, decoded: list[tuple[Exchange, EvaluationReport]]
    ) -> list[tuple[str, EvaluationReport]]:
        """The decoded evaluation reports that may count, with their sites (``report``)."""
        return [(entry.site, report) for entry, report in decoded if self.report(entry, report)]

    def report(self, entry, report: EvaluationReport) -> bool:
        """Whether a site's evaluation report may count: no more images than it holds."""
        if entry.site in self.quarantined:
            return False
        images = sum(score.images for score in report.classes)
        test_images = self.declared.get(entry.site, Declared({}, 0)).test_images
        if images > test_images:
            self._reject(entry, f"reports {images} test images, holds {test_images} (its sync)")
            return False
        return True
