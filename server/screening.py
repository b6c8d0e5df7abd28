"""What the server believes of a site: every reply screened before the strategy sees it.

Decoding (``wire.decode_update``) proves that a reply is well formed; it says nothing about
whether its numbers are plausible. A site could claim a million examples of a class it shares
with others and so own the class's merge, send rows for classes it never said it holds, send
tensors a million times too large, or register millions of classes so that the federation's
codebook outgrows what it can store and send. The ``Screen`` of a
step holds each site to what it can show (docs/security.md):

- **at the sync** (``enrol``): a site name once per step, counts a class could have, a bounded
  number of new classes per site and in all (``max-classes``: a codebook past one message
  reaches a site in parts, ``starfed.server.catch_up``); sites the operator's quarantine names
  sit out.
- **in a codebook phase** (``PhaseScreen``): the count of a row capped by what the site
  reported for that class at the sync (and, with ``max-class-share``, by its share of the
  class's sync counts); rows for classes it did not report rejected; a row whose change from
  the value the phase was sent with is beyond ``update-bound`` times the phase's median change
  of that field (over the rows that changed) rejected; mixtures whose variances or means are
  over ``mixture-bound`` times the phase's medians (their E‖x‖², every component by its
  weight, over it times the median norm²), or whose variances are below any fit's, rejected.
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
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from starfed.server.change_scale import ChangeScale
from starfed.server.federation import Finding
from starfed.server.messaging import reject
from starfed.shared import progress
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture
from starfed.shared.config import Options, knob, parse_site_names
from starfed.shared.data.site_folder import class_key
from starfed.shared.protocol import PRIVACY_EPSILON, Phase
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)

#: Images of one class at one site, at most: far beyond any real site, and a sum of such counts
#: over any number of sites a federation can have stays inside the wire's 64-bit counts.
MAX_IMAGES = 2**31 - 1
TEST_IMAGES_KEY = "test-images"  # sync metadata: the test images a site holds
CAPPED, REJECTED, QUARANTINED = "capped", "rejected", "quarantined"
#: No fitted variance is below the fitting's regularisation, which is added to every variance;
#: half of it leaves room for rounding.
VARIANCE_FLOOR = DEFAULT_REG / 2
#: Sites that must send a field in a phase before their median sets its bound: with one the
#: median is the sender's own change, with two the mean of an honest and a hostile one.
MIN_SITES = 3
#: The smallest per-element scale a tensor field starts at (prompts and heads are drawn with
#: std 0.02, shared/model; head biases start at 0): a class's reference size is at least this.
INIT_SCALE = 0.02


@dataclass(frozen=True)
class ScreeningOptions(Options):
    """The operator's bounds on what one site can do (knobs; docs/federation.md)."""

    update_bound: float = knob("update-bound")
    reference_bound: float = knob("reference-bound")
    history_bound: float = knob("history-bound")
    mixture_bound: float = knob("mixture-bound")
    max_class_share: float = knob("max-class-share")
    quarantine_after: int = knob("quarantine-after")
    quarantine_persists: bool = knob("quarantine-persists")
    site_names: str = knob("site-names")
    max_new_classes: int = knob("max-new-classes")
    max_classes: int = knob("max-classes")


@dataclass
class Enrolled:
    """What one site said at the sync: images per class key, and its test images (0 when it
    did not say, or said something that is no count: its reports then count no image)."""

    counts: dict[str, int]
    test_images: int


class Screen:
    """One step's screening: what each site enrolled with, the findings, who is quarantined."""

    def __init__(self, options: ScreeningOptions, step: int, scale: ChangeScale | None = None):
        self.options = options
        self.step = step
        self.scale = scale or ChangeScale()  # of the earlier steps: no sender of this one moves it
        self.observed: dict[str, list[float]] = {}  # this step's, for ``ChangeScale.save``
        self.registered = parse_site_names(options.site_names)  # node id -> the operator's name
        self.enrolled: dict[str, Enrolled] = {}  # site -> its sync
        self.findings: list[Finding] = []
        self.quarantined: dict[str, str] = {}  # site -> why
        # class -> (measure, site, what) of the kept row that went furthest this step: a tensor
        # field's change, a mixture's largest mean norm; whom to name if a result is invalid
        self.furthest: dict[str, tuple[float, str, str]] = {}

    # --- findings -------------------------------------------------------------------------

    def restore(self, findings: Iterable[Finding]) -> None:
        """A resumed step's findings from before its interruption
        (``Federation.step_findings``): they count toward ``quarantine-after`` as if just made,
        and the quarantines among them hold."""
        for finding in findings:
            self.findings.append(finding)
            if finding.action == QUARANTINED:
                self.quarantined[finding.site] = finding.reason

    def note(self, site: str, phase: str, round_index: int, action: str, reason: str,
             name: str = "") -> None:  # fmt: skip
        """Record one finding; a site reaching ``quarantine-after`` findings is quarantined."""
        self.findings.append(Finding(site, phase, round_index, action, reason, name))
        logger.warning("screening: %s %s of %s%s: %s", action, phase, site,
                       f" ({name[:60]})" if name else "", reason)  # fmt: skip
        limit = self.options.quarantine_after
        if limit and site not in self.quarantined:
            mine = sum(f.site == site and f.action != QUARANTINED for f in self.findings)
            if mine >= limit:
                why = f"{progress.counted(mine, 'finding')} in step {self.step + 1}"
                self.quarantined[site] = why
                self.findings.append(Finding(site, phase, round_index, QUARANTINED, why))
                logger.warning("screening: %s is quarantined for the rest of the step (%s)",
                               site, why)  # fmt: skip

    # --- the sync -------------------------------------------------------------------------

    def name_of(self, node_id: int, claimed: str) -> str:
        """The name a node is known by in this step: the operator's for a registered node
        (``site-names``), whatever it calls itself; else the name it gives."""
        name = self.registered.get(node_id)
        if name is None:
            return claimed
        if name != claimed:
            logger.warning("node %d calls itself %r; it is registered as %r: known as %r",
                           node_id, claimed[:60], name, name)  # fmt: skip
        return name

    def enrol(self, accepted: list, codebook: Codebook, held: Mapping[str, dict]) -> list:
        """The enrolments (``(Exchange, ClientUpdate)`` by node id) that may take part: sites
        ``held`` in quarantine, a second node with a taken name, a node using a name registered
        to another (``site-names``), impossible counts and too many new classes are rejected
        (the site sits the step out), each with a finding."""
        kept, names = [], dict[str, int]()
        registered_names = set(self.registered.values())
        for entry, update in accepted:
            site = entry.site
            # a name that is not the node's: its finding must not count against the name's site
            borrowed = site in names or (
                site in registered_names and self.registered.get(entry.node_id) != site
            )
            problem = None
            if site in held:
                problem = f"quarantined since step {held[site].get('step', 0) + 1}: " + str(
                    held[site].get("reason", "")
                )
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
        first — those whose new classes would take the federation past ``max-classes``, are
        rejected. A codebook past one message's limit is no bound: it reaches a site in parts
        (``starfed.server.catch_up``)."""
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
                continue  # fmt: skip
            brings[entry.node_id] = new
            kept.append((entry, update))
        while len(known | set().union(*brings.values())) > limit:
            node = max(brings, key=lambda n: (len(brings[n]), n))
            entry = next(e for e, _ in kept if e.node_id == node)
            self._reject(entry, f"its {len(brings.pop(node))} new classes would take the "
                         f"federation past {limit} classes (max-classes)")  # fmt: skip
            kept = [(e, u) for e, u in kept if e.node_id != node]
        for entry, update in kept:
            raw = update.metadata.get(TEST_IMAGES_KEY, "")
            test = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else 0
            counts = {class_key(e.name): e.count for e in update.entries}
            self.enrolled[entry.site] = Enrolled(counts, test)
        return kept

    def _reject(self, entry, reason: str, site: str | None = None) -> None:
        reject(entry, reason)
        self.note(site or entry.site, entry.phase, entry.round, REJECTED, reason)

    # --- codebook phases ------------------------------------------------------------------

    def phase(self, phase: Phase, round_index: int, codebook: Codebook) -> PhaseScreen:
        return PhaseScreen(self, phase, round_index, codebook)

    def caps(self, site: str) -> dict[str, int]:
        """The count each class of ``site`` may carry: what it reported at the sync, and with
        ``max-class-share`` < 1 at most that share of the class's sync counts over sites."""
        mine = self.enrolled.get(site, Enrolled({}, 0)).counts
        share = self.options.max_class_share
        caps = dict(mine)
        if share < 1:
            for key, count in mine.items():
                others = sum(e.counts.get(key, 0) for s, e in self.enrolled.items() if s != site)
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

    def report(self, entry, report: EvaluationReport) -> bool:
        """Whether a site's evaluation report may count: no more images than it holds."""
        if entry.site in self.quarantined:
            return False
        images = sum(score.images for score in report.classes)
        held = self.enrolled.get(entry.site, Enrolled({}, 0)).test_images
        if images > held:
            self._reject(entry, f"reports {images} test images, holds {held} (its sync)")
            return False
        return True


def _distance(value: torch.Tensor, sent: torch.Tensor) -> float:
    """‖value − sent‖: in one float32 pass, which overflows past ≈ 1e19 per element; such
    values are measured again in float64 (to ≈ 1e154), so a scaled row still has a size."""
    distance = float(torch.dist(value, sent))
    if math.isfinite(distance):
        return distance
    return float(torch.dist(value.double(), sent.double()))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _by_site(rows: Iterable[tuple[str, float]]) -> float:
    """The median over sites of each site's median: one vote per site, however many rows it
    sends (a site bringing ten classes of its own does not own the phase's median)."""
    per_site: dict[str, list[float]] = {}
    for site, value in rows:
        per_site.setdefault(site, []).append(value)
    return _median([statistics.median(values) for values in per_site.values()])


def reference_size(sent: torch.Tensor) -> float:
    """A class's own size before the phase: its row's norm, at least the initialisation's
    scale (``INIT_SCALE`` per element) — what no sender of the phase can move."""
    return max(float(sent.norm()), INIT_SCALE * math.sqrt(sent.numel()))


@dataclass
class _Rows:
    """What the first pass measured: per field, each row's change and its class's reference
    size (``reference_size``); per mixture field, each row's largest variance of a component
    (averaged over dimensions), its smallest variance, the largest norm of a component's mean,
    the dimension, and its second moment (``second_moment``)."""

    changes: dict[str, list[tuple[str, str, float, float]]] = field(default_factory=dict)
    mixtures: dict[str, list[tuple[str, str, float, float, float, int, float]]] = field(
        default_factory=dict
    )


def second_moment(mixture: GaussianMixture) -> float:
    """E‖x‖² of the mixture's features: Σ_k w_k (‖μ_k‖² + Σ_d σ²_kd). Every component counts by
    its weight, its mean and its spread: honest features of norm about r give about r² (the
    median norm of the means), a component far away carrying the weight gives its distance²,
    one of negligible weight almost nothing (replay draws it almost never)."""
    per_component = mixture.means.double().pow(2).sum(1) + mixture.variances.double().sum(1)
    return float((mixture.weights.double() * per_component).sum())


class PhaseScreen:
    """One phase round's screening: ``observe`` every decoded update (first pass), ``decide``,
    then ``apply`` to each again (second pass, same order)."""

    def __init__(self, screen: Screen, phase: Phase, round_index: int, codebook: Codebook):
        self.screen = screen
        self.phase = phase
        self.round = round_index
        self.codebook = codebook
        self.rows = _Rows()
        self.rejected: set[tuple[str, str]] = set()  # (site, class)
        self.capped: dict[tuple[str, str], int] = {}  # (site, class) -> count
        # sites that declare a privacy setting: their rows carry calibrated noise, not the
        # scale of training (neither observed for ``ChangeScale`` nor held to it)
        self.private: set[str] = set()

    def _note(self, site: str, action: str, reason: str, name: str = "") -> None:
        self.screen.note(site, self.phase.key, self.round, action, reason, name)

    def observe(self, site: str, update: ClientUpdate) -> None:
        """First pass: check counts and classes against the sync; measure every row."""
        if site in self.screen.quarantined:
            return
        if PRIVACY_EPSILON in update.metadata:
            self.private.add(site)
        caps = self.screen.caps(site)
        for entry in update.entries:
            key = (site, entry.name)
            cap = caps.get(class_key(entry.name))
            if cap is None:
                self.rejected.add(key)
                self._note(site, REJECTED, "a class it did not report at the sync", entry.name)
                continue
            counts = [entry.count] + [
                v.count for v in entry.values.values() if isinstance(v, GaussianMixture)
            ]
            if max(counts) > cap:
                self.capped[key] = cap
                synced = self.screen.enrolled[site].counts[class_key(entry.name)]
                why = f"its sync reported {synced}" if cap == synced else "max-class-share"
                self._note(site, CAPPED, f"count {max(counts)} capped at {cap} ({why})",
                           entry.name)  # fmt: skip
            sent = self.codebook[entry.name].values
            for name, value in entry.values.items():
                if isinstance(value, GaussianMixture):
                    self.rows.mixtures.setdefault(name, []).append((
                        site, entry.name, float(value.variances.mean(1).max()),
                        float(value.variances.min()), float(value.means.norm(dim=1).max()),
                        value.dim, second_moment(value),
                    ))  # fmt: skip
                elif name in sent:
                    held = self.codebook[entry.name].tensor(name)
                    change = _distance(value, held)
                    self.rows.changes.setdefault(name, []).append(
                        (site, entry.name, change, reference_size(held))
                    )

    def frozen_rows(self, site: str, names: list[str]) -> None:
        """Rows for finished (frozen) classes: no site trains them (``client.site``), so they
        are a finding, not merged."""
        for name in names:
            self._reject_row(site, name, "rows for a finished (frozen) class")

    def decide(self) -> None:
        """The bounds of what was observed; the rows beyond them rejected."""
        options = self.screen.options
        if options.update_bound or options.reference_bound or options.history_bound:
            for name, rows in self.rows.changes.items():
                self._bound_changes(name, rows)
        if self.screen.options.mixture_bound:
            for name, stats in self.rows.mixtures.items():
                self._bound_mixtures(name, stats)
        self._note_furthest()

    def _reject_row(self, site: str, cls: str, problem: str) -> None:
        if (site, cls) not in self.rejected:
            self.rejected.add((site, cls))
            self._note(site, REJECTED, problem, cls)

    def _bound_changes(self, name: str, rows: list[tuple[str, str, float, float]]) -> None:
        """Where ``MIN_SITES`` sites or more moved the field: ``update-bound`` × the median over
        sites of their changes (and the kept rows are this step's observations of the scale of
        honest changes). Where fewer did, their median is no bound (a lone sender's is its own
        change): each row is held to the tighter of ``reference-bound`` × its class's own size
        and ``history-bound`` × the scale of earlier steps (``ChangeScale``) × that size (a
        private site's to the first only: its noise is not the scale of training)."""
        options = self.screen.options
        # Rows that did not move say nothing of how far training moves one: a site that holds
        # a single class of its task has a one-logit loss and sends its rows back unchanged,
        # and with many small sites those are most rows (a median of 0 would reject every
        # site that trained at all).
        moved = [(site, change) for site, _, change, _ in rows if change > 0]
        if not moved:
            return
        senders = len({site for site, _ in moved})
        if senders < MIN_SITES:
            self._bound_lone(name, rows, senders)
            return
        if options.update_bound:
            median = _by_site(moved)
            largest = max(change for _, change in moved)
            logger.info("screening %s/%d %s: largest change %.3g × the median over %d sites "
                        "(bound %g)", self.phase.key, self.round, name,
                        largest / max(median, 1e-300), senders, options.update_bound)  # fmt: skip
            for site, cls, change, _ in rows:
                if change > options.update_bound * median:
                    self._reject_row(site, cls, f"{name} changed by {change:.3g}, over "
                                     f"{options.update_bound:g} × the median over "
                                     f"{senders} sites {median:.3g}")  # fmt: skip
        kept = [(site, change / size) for site, cls, change, size in rows
                if change > 0 and (site, cls) not in self.rejected
                and site not in self.private]  # fmt: skip
        if len({site for site, _ in kept}) >= MIN_SITES:
            per_site: dict[str, list[float]] = {}
            for site, ratio in kept:
                per_site.setdefault(site, []).append(ratio)
            observed = self.screen.observed.setdefault(name, [])
            observed += [statistics.median(ratios) for ratios in per_site.values()]

    def _bound_lone(self, name: str, rows: list, senders: int) -> None:
        options = self.screen.options
        scale = self.screen.scale.reference(name)
        sent_by = f"sent by {senders} site{'s' * (senders > 1)}: no median"
        for site, cls, change, size in rows:
            limits = []
            if options.reference_bound:
                limits.append(
                    (
                        options.reference_bound * size,
                        f"{options.reference_bound:g} × the class's size {size:.3g}",
                    )
                )
            if options.history_bound and scale is not None and site not in self.private:
                limits.append(
                    (
                        options.history_bound * scale * size,
                        f"{options.history_bound:g} × the scale of honest changes in "
                        f"earlier steps ({scale:.3g} × the class's size {size:.3g})",
                    )
                )
            if limits and change > min(limits)[0]:
                self._reject_row(site, cls, f"{name} changed by {change:.3g}, over "
                                 f"{min(limits)[1]} ({sent_by})")  # fmt: skip

    def _mixture_reference(self, name: str, rows: list) -> tuple[float, str]:
        """The mean norm a field's mixtures are measured by, and what it is: the median over
        sites where ``MIN_SITES`` or more send; else the median of the mixtures the codebook
        already holds (fitted and screened in earlier steps); else, in a federation's first
        fit by fewer sites, the senders' own median (docs/security.md)."""
        if len({r[0] for r in rows}) < MIN_SITES:
            held = [
                float(entry.mixture(name).means.norm(dim=1).max())
                for entry in self.codebook.entries.values()
                if name in entry.values
            ]
            if held:
                return _median(held), "the median of the codebook's fitted mixtures"
        return _by_site((r[0], r[4]) for r in rows), "the median over sites"

    def _bound_mixtures(self, name: str, rows: list) -> None:
        factor = self.screen.options.mixture_bound
        # Features of norm about r spread by at most about r² / D per dimension, so the
        # median norm of the means bounds plausible variances; a median of variances would
        # not (sites with few images fit components at the variance floor).
        norm, what = self._mixture_reference(name, rows)
        variance = max(norm**2 / rows[0][5], DEFAULT_REG)
        logger.info(
            "screening %s %s: largest variance %.3g × norm²/D, mean norm %.3g × %s, "
            "E‖x‖² %.3g × norm², smallest variance %.3g (bound %g)", self.phase.key, name,
            max(r[2] for r in rows) / variance, max(r[4] for r in rows) / max(norm, 1e-12),
            what, max(r[6] for r in rows) / (variance * rows[0][5]), min(r[3] for r in rows),
            factor,
        )  # fmt: skip
        for site, cls, hi, lo, n, dim, moment in rows:
            problem = None
            if hi > factor * variance:
                problem = (f"{name} variances up to {hi:.3g}, over {factor:g} × "
                           f"{variance:.3g} (the reference mean norm² / D)")  # fmt: skip
            elif lo < VARIANCE_FLOOR:
                problem = f"{name} variances down to {lo:.3g}, below any fit's"
            elif n > factor * max(norm, 1e-12):
                problem = f"{name} means of norm {n:.3g}, over {factor:g} × {what}"
            elif moment > factor * variance * dim:
                problem = (f"{name} weighted E‖x‖² {moment:.3g}, over {factor:g} × "
                           f"{variance * dim:.3g} (the reference mean norm²)")  # fmt: skip
            if problem:
                self._reject_row(site, cls, problem)

    def _note_furthest(self) -> None:
        """Per class, the kept row that went furthest (``Screen.furthest``), from what the first
        pass measured: no second look at the values."""
        measured = [
            (change, site, cls, f"{name} changed by {change:.3g}")
            for name, rows in self.rows.changes.items()
            for site, cls, change, _ in rows
        ] + [
            (norm, site, cls, f"{name} means of norm up to {norm:.3g}")
            for name, rows in self.rows.mixtures.items()
            for site, cls, _, _, norm, _, _ in rows
        ]  # fmt: skip
        furthest = self.screen.furthest
        for measure, site, cls, what in measured:
            kept = (site, cls) not in self.rejected and site not in self.screen.quarantined
            if kept and measure > furthest.get(cls, (-1.0, "", ""))[0]:
                furthest[cls] = (measure, site, what)

    def apply(self, site: str, update: ClientUpdate) -> ClientUpdate | None:
        """Second pass: the update as it may be merged (None: its site is quarantined)."""
        if site in self.screen.quarantined:
            return None
        entries = []
        for entry in update.entries:
            key = (site, entry.name)
            if key in self.rejected:
                continue
            if key in self.capped:
                entry = _capped(entry, self.capped[key])
            entries.append(entry)
        return replace(update, entries=tuple(entries))


def _capped(entry, cap: int):
    """The entry with its count, and its mixtures' counts, at most ``cap``."""
    values = {
        name: replace(value, count=min(value.count, cap))
        if isinstance(value, GaussianMixture) else value
        for name, value in entry.values.items()
    }  # fmt: skip
    return replace(entry, count=min(entry.count, cap), values=values)
