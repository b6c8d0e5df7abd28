"""The screen stage of a codebook phase: every row measured, then held to bounds (``screen``).

The stage between decoding (``server.decode``) and the merge. Its input is a phase round's
decoded updates; its output (``Screened``) the updates kept, the classes they answer for and
the findings it made. A phase is read twice (``starfed.server.screening`` says what the
screening believes of a site and why): ``PhaseScreen.observe`` checks each reply's counts and
classes against the site's sync and measures every row (``Change``, ``MixtureRow``); ``decide``
sets each field's bounds from what was measured and rejects the rows beyond them; ``apply``
hands on the screened updates. The decoded updates are held between the passes: their tensors
are views of the replies' bytes, which the phase holds anyway, so that costs a few objects per
update, not a copy — except with ``wire-dtype = "float16"``, whose rows are converted: then the
phase holds their float32 copies, twice the replies' bytes. Costs: one pass over the reply's
values per site and a median per field, linear in the rows (sites × classes) of the phase.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from starfed.server.decode import Decoded, refused_classes, without_cyclic_gc
from starfed.server.records import CAPPED, REJECTED, Finding
from starfed.server.release_bounds import Optimizer, TrainingRelease
from starfed.server.robust import MIN_HOLDERS, MIXTURE_OUTLIER, ROBUST_MERGE, mixture_distances
from starfed.server.screening import Furthest, Screen
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture
from starfed.shared.data.site_folder import class_key
from starfed.shared.protocol import Phase

logger = logging.getLogger(__name__)

#: No fitted variance is below the fitting's regularisation, which is added to every variance;
#: half of it leaves room for rounding.
VARIANCE_FLOOR = DEFAULT_REG / 2
#: Sites that must send a field in a phase before their median sets its bound: with one the
#: median is the sender's own change, with two the mean of an honest and a hostile one.
MIN_SITES = 3
#: The smallest per-element scale a tensor field starts at (prompts and heads are drawn with
#: std 0.02, shared/model; head biases start at 0): a class's reference size is at least this.
INIT_SCALE = 0.02
#: How much further than Adam's an honest plain-SGD change reaches past the scale of earlier
#: steps: ``history-bound`` is this many times wider for stage 1's rows. SGD steps by the mean
#: gradient of the batch, so an epoch's partial batch (N mod batch-size images) gives its few
#: images a whole step: an honest class with 2 of a 4-image batch moved its prompt 27.5 × the
#: scale (its gradient 36, against 1.3 in the full batch), and one image alone would move it
#: about twice as far; Adam moves each coordinate by about its rate whatever the batch (at most
#: 2.2 × the scale measured). Counts cannot say how small a site's partial batch is: a site
#: declares them (docs/security.md §1b).
SGD_TAIL = 5


def _distance(value: torch.Tensor, sent: torch.Tensor) -> float:
    """‖value − sent‖: in one float32 pass, which overflows past ≈ 1e19 per element; such
    values are measured again in float64 (to ≈ 1e154), so a scaled row still has a size."""
    distance = float(torch.dist(value, sent))
    if math.isfinite(distance):
        return distance
    return float(torch.dist(value.double(), sent.double()))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _site_medians(rows: Iterable[tuple[str, float]]) -> list[float]:
    """Each site's median of its values: one vote per site, however many rows it sends."""
    per_site: dict[str, list[float]] = {}
    for site, value in rows:
        per_site.setdefault(site, []).append(value)
    return [statistics.median(values) for values in per_site.values()]


def _by_site(rows: Iterable[tuple[str, float]]) -> float:
    """The median over sites of each site's median (``_site_medians``: a site bringing ten
    classes of its own does not own the phase's median)."""
    return _median(_site_medians(rows))


def reference_size(sent: torch.Tensor) -> float:
    """A class's own size before the phase: its row's norm, at least the initialisation's
    scale (``INIT_SCALE`` per element) — what no sender of the phase can move."""
    return max(float(sent.norm()), INIT_SCALE * math.sqrt(sent.numel()))


@dataclass(frozen=True)
class Change:
    """One row's change in a tensor field, its class's reference size (``reference_size``),
    and for a private site's row the most its release can move it
    (``TrainingRelease.row_bound``)."""

    site: str
    cls: str
    change: float
    size: float
    released: float | None = None


@dataclass(frozen=True)
class MixtureRow:
    """What one row's mixture field measures: the largest variance of a component (averaged
    over dimensions), the smallest variance, the largest norm of a component's mean, the
    dimension, and the second moment (``second_moment``); and the mixture itself, with its
    count as capped (``outlying_mixtures`` compares it with the class's other sites')."""

    site: str
    cls: str
    variance: float
    smallest: float
    norm: float
    dim: int
    moment: float
    mixture: GaussianMixture = field(compare=False, repr=False)


@dataclass
class _Rows:
    """What the first pass measured, per field."""

    changes: dict[str, list[Change]] = field(default_factory=dict)
    mixtures: dict[str, list[MixtureRow]] = field(default_factory=dict)


def second_moment(mixture: GaussianMixture) -> float:
    """E‖x‖² of the mixture's features: Σ_k w_k (‖μ_k‖² + Σ_d σ²_kd). Every component counts by
    its weight, its mean and its spread: honest features of norm about r give about r² (the
    median norm of the means), a component far away carrying the weight gives its distance²,
    one of negligible weight almost nothing (replay draws it almost never)."""
    per_component = mixture.means.double().pow(2).sum(1) + mixture.variances.double().sum(1)
    return float((mixture.weights.double() * per_component).sum())


@dataclass(frozen=True)
class Screened:
    """What the screen stage hands the merge: the updates kept (capped where they claimed too
    much, without rejected rows), in the decoded order; the classes they answer for (rows
    kept, or refused by a private site whose budget is exhausted); the findings it made."""

    updates: tuple[ClientUpdate, ...]
    answered: frozenset[str]
    findings: tuple[Finding, ...]
    sites: tuple[str, ...] = ()  # who sent each update (``server.contributions`` keeps them)


def screen_phase(
    screen: Screen,
    decoded: list[Decoded],
    phase: Phase,
    round_index: int,
    codebook: Codebook,
    in_play: Iterable[str],
) -> Screened:
    """One phase round's decoded updates (made from ``codebook``) without rows of classes not
    in ``in_play`` (rows of a frozen class are a finding), measured (first pass), then held to
    the bounds (second pass, same order)."""
    playing = set(in_play)
    phase_screen = PhaseScreen(screen, phase, round_index, codebook)
    known = len(screen.findings)
    stripped = []
    with without_cyclic_gc():
        for entry, update in decoded:
            stray = [e.name for e in update.entries if e.name not in playing]
            if stray:
                logger.info(
                    "node %s sent rows of classes not in play: %s", entry.node_id, stray[:10]
                )
                # one lookup per row: ``.frozen`` walks every class
                frozen = [n for n in stray if n in codebook and codebook[n].frozen]
                phase_screen.frozen_rows(entry.site, frozen)
            update = update.only(playing)
            phase_screen.observe(entry.site, update)
            stripped.append((entry, update))
    phase_screen.decide()
    kept: list[ClientUpdate] = []
    senders: list[str] = []
    answered: set[str] = set()
    for entry, update in stripped:
        screened = phase_screen.apply(entry.site, update)
        if screened is None:
            continue
        answered.update(e.name for e in screened.entries)
        answered.update(refused_classes(update))  # answered: kept as they are
        kept.append(screened)
        senders.append(entry.site)
    findings = tuple(screen.findings[known:])
    return Screened(tuple(kept), frozenset(answered), findings, tuple(senders))


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
        options = screen.options
        # a private site's DP-SGD in a training phase, as the run config fixes it
        # (client.privacy): the bound on its rows is derived from it
        self.release = None
        if phase in (Phase.STAGE1, Phase.STAGE2):
            one = phase is Phase.STAGE1
            self.release = TrainingRelease.of(
                phase,
                options.batch_size,
                options.stage1_epochs if one else options.stage2_epochs,
                options.stage1_clip if one else options.stage2_clip,
                options.privacy_delta,
            )

    def _note(self, site: str, action: str, reason: str, name: str = "") -> None:
        self.screen.note(site, self.phase.key, self.round, action, reason, name)

    def observe(self, site: str, update: ClientUpdate) -> None:
        """First pass: check counts and classes against the sync; measure every row."""
        if site in self.screen.quarantined:
            return
        self.screen.privacy_claim(site, self.phase.key, self.round, update.metadata)
        private = self.screen.private(site)
        caps = self.screen.caps(site)
        # the released counts of its task's classes, as capped: its DP-SGD's sampling
        released = [
            min(e.count, cap) for e in update.entries if (cap := caps.get(class_key(e.name)))
        ]
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
                synced = self.screen.declared[site].counts[class_key(entry.name)]
                why = f"its sync reported {synced}" if cap == synced else "max-class-share"
                self._note(site, CAPPED, f"count {max(counts)} capped at {cap} ({why})", entry.name)
            sent = self.codebook[entry.name].values
            for name, value in entry.values.items():
                if isinstance(value, GaussianMixture):
                    self.rows.mixtures.setdefault(name, []).append(
                        MixtureRow(
                            site,
                            entry.name,
                            float(value.variances.mean(1).max()),
                            float(value.variances.min()),
                            float(value.means.norm(dim=1).max()),
                            value.dim,
                            second_moment(value),
                            replace(value, count=min(value.count, cap)),
                        )
                    )
                elif name in sent:
                    before = self.codebook[entry.name].tensor(name)
                    change = _distance(value, before)
                    self.rows.changes.setdefault(name, []).append(
                        Change(
                            site,
                            entry.name,
                            change,
                            reference_size(before),
                            self._release_bound(private, released, before),
                        )
                    )

    def _release_bound(
        self, private: bool, counts: list[int], before: torch.Tensor
    ) -> float | None:
        """The most a private site's training release of a task of ``counts`` released images
        per class moves the row that was ``before`` (``TrainingRelease.row_bound``); None for
        a site that is not private, or a phase without a training release."""
        if not private or self.release is None or not counts:
            return None
        return self.release.row_bound(counts, before.numel(), float(before.norm()))

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
        if self.screen.options.merge == ROBUST_MERGE:
            for name, stats in self.rows.mixtures.items():
                self._outlying_mixtures(name, stats)
        self._note_furthest()

    def _reject_row(self, site: str, cls: str, problem: str) -> None:
        if (site, cls) not in self.rejected:
            self.rejected.add((site, cls))
            self._note(site, REJECTED, problem, cls)

    def _bound_changes(self, name: str, rows: list[Change]) -> None:
        """Every row is held to the tighter of ``reference-bound`` × its class's own size and
        ``history-bound`` × the scale of earlier steps (``ChangeScale``) × that size (×
        ``SGD_TAIL`` for stage 1's rows) — a private site's to its release's bound instead of
        the second (its noise is not the scale of training) — whatever the number of senders
        (``_bound_rows``). Where ``MIN_SITES`` sites or more moved the field, also to
        ``update-bound`` × the median over sites of their changes (and the kept rows of sites
        that are not private are this step's observations of the scale of honest changes);
        where fewer did, their median is no bound (a lone sender's is its own change)."""
        options = self.screen.options
        # Rows that did not move say nothing of how far training moves one: a site that holds
        # a single class of its task has a one-logit loss and sends its rows back unchanged,
        # and with many small sites those are most rows (a median of 0 would reject every
        # site that trained at all).
        moved = [(row.site, row.change) for row in rows if row.change > 0]
        if not moved:
            return
        senders = len({site for site, _ in moved})
        self._bound_rows(name, rows, senders)
        if senders < MIN_SITES:
            return
        if options.update_bound:
            median = _by_site(moved)
            largest = max(change for _, change in moved)
            logger.debug(
                "screening %s/%d %s: largest change %.3g × the median over %d sites (bound %g)",
                self.phase.key,
                self.round,
                name,
                largest / max(median, 1e-300),
                senders,
                options.update_bound,
            )
            for row in rows:
                if row.change > options.update_bound * median:
                    self._reject_row(
                        row.site,
                        row.cls,
                        f"{name} changed by {row.change:.3g}, over "
                        f"{options.update_bound:g} × the median over "
                        f"{senders} sites {median:.3g}",
                    )
        kept = [  # a private site's rows carry noise, not the scale of honest training
            (row.site, row.change / row.size)
            for row in rows
            if row.change > 0
            and (row.site, row.cls) not in self.rejected
            and not self.screen.private(row.site)
        ]
        if len({site for site, _ in kept}) >= MIN_SITES:
            self.screen.observed.setdefault(name, []).extend(_site_medians(kept))

    def _bound_rows(self, name: str, rows: list[Change], senders: int) -> None:
        """Every row held to references no sender of the phase moves, whatever the number of
        senders: a class one site alone holds in a phase where three send is that site's as
        much as in a phase it sends alone (issue 43, attack 1). A row trained by plain SGD
        (stage 1) is allowed ``SGD_TAIL`` × the history bound: a partial batch moves it
        further."""
        options = self.screen.options
        scale = self.screen.scale.reference(name)
        sgd = self.release is not None and self.release.optimizer is Optimizer.SGD
        history = options.history_bound * (SGD_TAIL if sgd else 1)
        sent_by = f"sent by {senders} site{'s' * (senders > 1)}" + (
            ": no median" if senders < MIN_SITES else ""
        )
        for row in rows:
            site, size = row.site, row.size
            limits = []
            if options.reference_bound:
                limits.append(
                    (
                        options.reference_bound * size,
                        f"{options.reference_bound:g} × the class's size {size:.3g}",
                    )
                )
            if row.released is not None and self.release is not None:
                limits.append(
                    (
                        row.released,
                        f"the bound of its privacy release {row.released:.3g} (its DP-SGD: "
                        f"{self.release.optimizer.value}, clip {self.release.clip:g})",
                    )
                )
            elif history and scale is not None and not self.screen.private(site):
                limits.append(
                    (
                        history * scale * size,
                        f"{history:g} × the scale of honest changes in "
                        f"earlier steps ({scale:.3g} × the class's size {size:.3g})",
                    )
                )
            if limits and row.change > min(limits)[0]:
                self._reject_row(
                    site,
                    row.cls,
                    f"{name} changed by {row.change:.3g}, over {min(limits)[1]} ({sent_by})",
                )

    def _mixture_reference(self, name: str, rows: list[MixtureRow]) -> tuple[float, str]:
        """The mean norm a field's mixtures are measured by, and what it is: the median over
        sites where ``MIN_SITES`` or more send; else the median of the mixtures the codebook
        already holds (fitted and screened in earlier steps); else, in a federation's first
        fit by fewer sites, the senders' own median (docs/security.md)."""
        if len({r.site for r in rows}) < MIN_SITES:
            fitted = [
                float(entry.mixture(name).means.norm(dim=1).max())
                for entry in self.codebook.entries.values()
                if name in entry.values
            ]
            if fitted:
                return _median(fitted), "the median of the codebook's fitted mixtures"
        return _by_site((r.site, r.norm) for r in rows), "the median over sites"

    def _bound_mixtures(self, name: str, rows: list[MixtureRow]) -> None:
        factor = self.screen.options.mixture_bound
        # Features of norm about r spread by at most about r² / D per dimension, so the
        # median norm of the means bounds plausible variances; a median of variances would
        # not (sites with few images fit components at the variance floor).
        norm, what = self._mixture_reference(name, rows)
        variance = max(norm**2 / rows[0].dim, DEFAULT_REG)
        logger.debug(
            "screening %s %s: largest variance %.3g × norm²/D, mean norm %.3g–%.3g × %s, "
            "E‖x‖² %.3g–%.3g × norm², smallest variance %.3g (bound %g)",
            self.phase.key,
            name,
            max(r.variance for r in rows) / variance,
            min(r.norm for r in rows) / max(norm, 1e-12),
            max(r.norm for r in rows) / max(norm, 1e-12),
            what,
            min(r.moment for r in rows) / (variance * rows[0].dim),
            max(r.moment for r in rows) / (variance * rows[0].dim),
            min(r.smallest for r in rows),
            factor,
        )
        for row in rows:
            problem = None
            if row.variance > factor * variance:
                problem = (
                    f"{name} variances up to {row.variance:.3g}, over {factor:g} × "
                    f"{variance:.3g} (the reference mean norm² / D)"
                )
            elif row.smallest < VARIANCE_FLOOR:
                problem = f"{name} variances down to {row.smallest:.3g}, below any fit's"
            elif row.norm > factor * max(norm, 1e-12):
                problem = f"{name} means of norm {row.norm:.3g}, over {factor:g} × {what}"
            elif row.moment > factor * variance * row.dim:
                problem = (
                    f"{name} weighted E‖x‖² {row.moment:.3g}, over {factor:g} × "
                    f"{variance * row.dim:.3g} (the reference mean norm²)"
                )
            # from below too: a mixture deflated towards zero (means of norm 10⁻⁴, variances
            # at the floor) is as false as an inflated one and draws the replay's features of
            # its class onto the origin (issue 43, attack 3)
            elif row.norm < max(norm, 1e-12) / factor:
                problem = f"{name} means of norm up to {row.norm:.3g}, under 1/{factor:g} of {what}"
            elif row.moment < variance * row.dim / factor:
                problem = (
                    f"{name} weighted E‖x‖² {row.moment:.3g}, under 1/{factor:g} of "
                    f"{variance * row.dim:.3g} (the reference mean norm²)"
                )
            if problem:
                self._reject_row(row.site, row.cls, problem)

    def _outlying_mixtures(self, name: str, rows: list[MixtureRow]) -> None:
        """Where ``MIN_HOLDERS`` or more sites' mixtures of a class are left after the bounds,
        a site's whose mean lies far from the others' (``outlying_mixtures``) is rejected: a
        finding against the site, counted toward ``quarantine-after`` (issue 43, attack 3: the
        median merge left it out of the pool with only a log line, the strategy not knowing
        whose update it was)."""
        by_class: dict[str, list[MixtureRow]] = {}
        for row in rows:
            if (row.site, row.cls) not in self.rejected and row.site not in self.screen.quarantined:
                by_class.setdefault(row.cls, []).append(row)
        for cls, sent in by_class.items():
            if len(sent) < MIN_HOLDERS:
                continue
            for row, far in zip(sent, mixture_distances([r.mixture for r in sent]), strict=True):
                if far > MIXTURE_OUTLIER:
                    self._reject_row(
                        row.site,
                        cls,
                        f"{name}'s mean {far:.3g} × as far from the median of {len(sent)} "
                        f"sites' as theirs are, over {MIXTURE_OUTLIER:g}",
                    )

    def _note_furthest(self) -> None:
        """Per class, the kept row that went furthest (``Screen.furthest``), from what the first
        pass measured: no second look at the values."""
        measured = [
            (row.cls, Furthest(row.change, row.site, f"{name} changed by {row.change:.3g}"))
            for name, rows in self.rows.changes.items()
            for row in rows
        ] + [
            (row.cls, Furthest(row.norm, row.site, f"{name} means of norm up to {row.norm:.3g}"))
            for name, rows in self.rows.mixtures.items()
            for row in rows
        ]
        furthest = self.screen.furthest
        for cls, row in measured:
            kept = (row.site, cls) not in self.rejected and row.site not in self.screen.quarantined
            if kept and row.measure > (furthest[cls].measure if cls in furthest else -1.0):
                furthest[cls] = row

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


def _capped(entry: ClassEntry, cap: int) -> ClassEntry:
    """The entry with its count, and its mixtures' counts, at most ``cap``."""
    values = {
        name: replace(value, count=min(value.count, cap))
        if isinstance(value, GaussianMixture)
        else value
        for name, value in entry.values.items()
    }
    return replace(entry, count=min(entry.count, cap), values=values)
