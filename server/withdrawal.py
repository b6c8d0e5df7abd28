"""A site leaves: its data's influence taken out of the shared codebook (GDPR Art. 17).

The codebook is per class: a class's prompts, head rows and mixtures are the merge of the rows
its holders sent in the step that trained it (``server.contributions`` keeps each site's).
So a site's leaving is, class by class (docs/security.md#a-site-leaves):

- every class only it brought is removed, with its rows;
- every class it shared is merged again from the other holders' kept rows, by the strategy's
  own ``merge`` (median or mean, as the run was configured), mixtures included;
- the server's replays are run again: the first level for the classes merged again (their
  prompts against every other class's key, then their keys), the head's over every class,
  with the last step's seeds;
- the site is unregistered: out of the registry, quarantined for good (a new ``starfed server
  sites add`` lets it back), its rows forgotten; ``withdrawals.jsonl`` records it.

What this does not remove is said by ``plan`` (``--dry-run``): the later steps in which other
sites trained on a codebook that held its values, the kept checkpoints that hold them, and the
exports made before. The change is one commit (``Federation.withdraw``) under the folder's lock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from starfed.server import folder_lock
from starfed.server.contributions import Contributions, owners
from starfed.server.federation import Federation
from starfed.server.folder_files import (
    CHECKPOINTS_DIR,
    CONTRIBUTIONS_FILE,
    IDENTITY_FILE,
    PREVIOUS_FILE,
    FederationError,
    Identity,
    read_exports,
    read_withdrawals,
)
from starfed.server.quarantine import read_quarantine, write_quarantine
from starfed.server.records import Withdrawal, now
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.framing import read_message
from starfed.shared.config import ProtocolOptions, parse
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.protocol import PHASES
from starfed.shared.run_status import FAILED

if TYPE_CHECKING:  # imported where a withdrawal runs: they load the backbones' libraries and
    # the merge's (seconds of imports) that every `starfed` command would pay, `--help` included
    from starfed.server.strategy import Strategy
    from starfed.shared.model.backbones import Backbones
    from starfed.shared.model.training import TrainConfig


class WithdrawalError(FederationError):
    """A withdrawal that cannot be made (one line: what and why)."""


@dataclass(frozen=True)
class Plan:
    """What withdrawing ``site`` changes, and what it leaves (``--dry-run`` prints it)."""

    site: str
    removed: tuple[str, ...]  # classes only it brought
    remerged: tuple[str, ...]  # classes it shared with others
    touched: dict[int, tuple[str, ...]]  # later step (1-based) -> the classes others trained
    holding: tuple[str, ...]  # exports made before and kept codebook files holding its values
    steps: int  # steps completed
    first: int  # the step of its first rows (0-based)
    exact: str  # why exact mode is not available ("" when it is)

    def lines(self) -> list[str]:
        """The plan as an operator reads it."""
        out = [
            f"withdraw {self.site} after {self.steps} steps: "
            f"{len(self.removed)} classes removed, {len(self.remerged)} merged again without it",
        ]
        out += [f"  removed: {name}" for name in self.removed]
        out += [f"  merged again: {name}" for name in self.remerged]
        for step, classes in self.touched.items():
            out.append(
                f"  not undone: in step {step} other sites trained {', '.join(classes)} on a "
                f"codebook holding {self.site}'s values"
            )
        out += [f"  still holding its values: {path}" for path in self.holding]
        out.append(
            f"  exact mode (--exact): {self.exact}"
            if self.exact
            else f"  exact mode (--exact): goes back to the checkpoint after step {self.first} "
            f"and runs steps {self.first + 1}-{self.steps} again without {self.site}"
        )
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "touched": {str(s): list(c) for s, c in self.touched.items()}}


def plan(federation: Federation, site: str) -> Plan:
    """What withdrawing ``site`` would change, from the registry, the kept rows and the history;
    ``WithdrawalError`` when it cannot be made."""
    if site in {w.site for w in read_withdrawals(federation.root)}:
        raise WithdrawalError(f"{site} has already left this federation")
    checkpoint = federation.checkpoints.last_checkpoint()
    if checkpoint is None:
        raise WithdrawalError(f"{federation.root} has no codebook yet: nothing to withdraw")
    if checkpoint.position.running:
        raise WithdrawalError(
            f"step {checkpoint.position.step + 1} is running: withdraw between steps "
            "(`starfed server resume` finishes it)"
        )
    holders = {n: h for n, h in _holders(federation, site).items() if n in checkpoint.classes}
    if not holders:
        raise WithdrawalError(f"{site} brought no class to this federation")
    removed = tuple(n for n in checkpoint.classes if holders.get(n) == [site])
    remerged = tuple(n for n in checkpoint.classes if n in holders and n not in removed)
    first = min(federation.registry[n].step for n in holders if n in federation.registry)
    brought = set(holders)
    touched = {
        record.step + 1: tuple(c for c in record.classes if c not in brought)
        for record in federation.history()
        if record.step > first and record.status != FAILED
    }
    ours = set(removed) | set(remerged)
    exported = [
        f"export {e.path} ({e.when}, version {e.version})"
        for e in read_exports(federation.root)
        if ours & set(e.classes)
    ]
    holding = (
        exported
        + [PREVIOUS_FILE]
        + [
            f"{CHECKPOINTS_DIR}/{path.name}"
            for completed, path in sorted(
                Identity(
                    federation.root, federation.fingerprint, federation.dims
                ).step_checkpoints()
            )
            if completed > first
        ]
    )
    return Plan(
        site,
        removed,
        remerged,
        {s: c for s, c in touched.items() if c},
        tuple(holding),
        checkpoint.position.step,
        first,
        _exact(federation, first),
    )


def _holders(federation: Federation, site: str) -> dict[str, list[str]]:
    """The classes ``site`` sent rows of, each with the sites whose rows are kept, from the
    kept rows (``server.contributions``). A site the registry lists for a class it brought
    when it was frozen already sent none. A folder without kept rows (written before them)
    falls back to the registry's sites."""
    path = federation.root / CONTRIBUTIONS_FILE
    try:
        rows = owners(read_message(path).metadata) if path.is_file() else []
    except CodebookError as err:
        raise FederationError(f"{path}: {err}") from None
    if rows:
        by_class: dict[str, list[str]] = {}
        for owner, name in sorted(rows):
            by_class.setdefault(name, []).append(owner)
        return {n: sites for n, sites in by_class.items() if site in sites}
    registry = federation.registry
    return {n: sorted(r.sites) for n, r in registry.items() if site in r.sites}


def _exact(federation: Federation, first: int) -> str:
    """Why an exact withdrawal is not available for a site whose first rows came at step
    ``first`` ("" when it is): it needs the checkpoint before that step."""
    if first == 0:
        return (
            "not available: the site took part from the first step, so a federation without it "
            "starts from nothing (a new federation folder, with the other sites)"
        )
    if not (federation.root / CHECKPOINTS_DIR / f"step-{first:04d}.bin").is_file():
        return (
            f"not available: {CHECKPOINTS_DIR}/step-{first:04d}.bin, the checkpoint before its "
            "first step, is not kept (it is kept from this version of starfed on)"
        )
    return ""


def replayed(working: Codebook, chosen: Plan, setting: Setting, order: list[str]) -> Codebook:
    """``merged_without``'s codebook after the replays run again with the last step's seeds
    (the module docstring), in the class ``order`` (the codebook's, less the removed)."""
    from starfed.server import replay  # not at the top: see TYPE_CHECKING above

    last, names = max(chosen.steps - 1, 0), set(chosen.remerged)
    backbones, train = setting.backbones, setting.train
    if names:
        working = replay.replay_first_level(working, backbones, train, last)
    working = replay.replay_head(working, train, last, names, backbones.device)
    return replace(working, entries={n: working[n] for n in order})


def merged_without(
    codebook: Codebook,
    rows: Contributions,
    chosen: Plan,
    setting: Setting,
    class_steps: dict[str, int],
) -> Codebook:
    """``codebook`` with ``chosen.site``'s lone classes removed and its shared classes merged
    again, phase by phase, from the other holders' ``rows`` by the strategy's ``merge``; those
    thawed and last, as the first-level replay wants the classes it trains."""
    from starfed.server.strategy import PhaseState  # not at the top: see TYPE_CHECKING above

    out = codebook.without(chosen.removed)
    others = rows.without(chosen.site, chosen.removed)
    lost = [n for n in chosen.remerged if not others.holders(n)]
    if lost:
        raise WithdrawalError(
            f"no other site's rows of {lost[0]} are kept (kept from the first step of this "
            "version of starfed on): it cannot be merged again without the site"
        )
    names = set(chosen.remerged)
    # a merge leaves frozen classes as they are: the shared ones are thawed
    order = [n for n in out.names if n not in names] + list(chosen.remerged)
    working = replace(out, entries={n: replace(out[n], frozen=n not in names) for n in order})
    last = max(chosen.steps - 1, 0)
    for phase in (spec.phase for spec in PHASES if schema.trained_in(spec.phase)):
        updates = others.updates(phase, names, working)
        state = PhaseState(
            last, 0, working, chosen.remerged, class_steps, setting.backbones, setting.train
        )
        working = setting.strategy.merge(updates, state)
    return working


@dataclass(frozen=True)
class Setting:
    """What a withdrawal merges and replays with: the federation's last run's."""

    strategy: Strategy
    backbones: Backbones
    train: TrainConfig

    @classmethod
    def of(cls, federation: Federation) -> Setting:
        """The merge, backbones and training config of the last server run (its
        ``metrics.json``); ``WithdrawalError`` when there is none or it names other backbones."""
        from starfed.server.robust import with_merge  # not at the top: see TYPE_CHECKING above
        from starfed.shared.model.training import TrainConfig

        run_config = federation.metrics().get("config", {}).get("run_config")
        if not run_config:
            raise WithdrawalError(
                f"{federation.root} has no metrics.json of a server run: its merge and "
                "backbones are unknown"
            )
        values = parse(run_config)
        merge = ProtocolOptions.from_config(values).merge
        strategy = with_merge(None, merge)
        backbones = BackboneOptions.from_config(values).load(str(values["device"]))
        if backbones.fingerprint != federation.fingerprint:
            raise WithdrawalError(f"{federation.root}: its last run's backbones are not its own")
        return cls(strategy, backbones, TrainConfig.from_config(values))


def withdraw(federation: Federation, site: str, setting: Setting, request: str = "") -> Withdrawal:
    """Withdraw ``site`` now (immediate mode), under the folder's lock; the record made (with the
    site's signed ``request``, when it asked)."""
    with folder_lock.locked(federation.root, f"withdraw {site}"):
        federation.recover()
        chosen = plan(federation, site)
        codebook = federation.checkpoints.codebook()
        class_steps = {n: r.step for n, r in federation.registry.items()}
        rows = federation.contributions()
        merged = merged_without(codebook, rows, chosen, setting, class_steps)
        order = [n for n in codebook.names if n not in chosen.removed]
        new = replayed(merged, chosen, setting, order)
        record = Withdrawal(
            site,
            now(),
            chosen.steps,
            chosen.removed,
            chosen.remerged,
            tuple(chosen.touched),
            new.version,
            request=request,
        )
        federation.withdraw(record, new)
    return record


def withdraw_exact(federation: Federation, site: str, request: str = "") -> Withdrawal:
    """Withdraw ``site`` exactly: the federation goes back to the checkpoint before the site's
    first step, without it, under the folder's lock; the steps since are run again by the next
    ``starfed server run`` (the other sites' task folders and the run's seeds make them the
    steps of a federation the site never joined). The record made."""
    with folder_lock.locked(federation.root, f"withdraw {site} --exact"):
        federation.recover()
        chosen = plan(federation, site)
        if chosen.exact:
            raise WithdrawalError(f"withdraw {site} --exact: {chosen.exact}")
        codebook = federation.checkpoints.kept_step(chosen.first)
        again = tuple(n for n, r in federation.registry.items() if r.step >= chosen.first)
        record = Withdrawal(
            site,
            now(),
            chosen.steps,
            removed=again,
            touched=tuple(chosen.touched),
            codebook_version=codebook.version,
            rerun_from=chosen.first,
            request=request,
        )
        federation.withdraw(record, codebook)
    return record


def done_line(record: Withdrawal) -> str:
    """What a withdrawal did, in one line."""
    if record.rerun_from is not None:
        return (
            f"{record.site} withdrawn exactly: the federation is back after step "
            f"{record.rerun_from}; the next `starfed server run` runs steps "
            f"{record.rerun_from + 1}-{record.steps} again without it"
        )
    return (
        f"{record.site} withdrawn: {len(record.removed)} classes removed, "
        f"{len(record.remerged)} merged again without it (codebook version "
        f"{record.codebook_version})"
    )


def readmit(root: Path, site: str) -> bool:
    """A withdrawn ``site`` let back (a new ``starfed server sites add``): its quarantine entry
    lifted, under the folder's lock; whether there was one. It brings its data again as a new
    site: nothing of what it had is restored."""
    if not (root / IDENTITY_FILE).is_file():
        return False
    with folder_lock.locked(root, f"sites add {site}"):
        quarantine = read_quarantine(root)
        if site not in {w.site for w in read_withdrawals(root)} or site not in quarantine:
            return False
        del quarantine[site]
        write_quarantine(root, quarantine)
    return True
