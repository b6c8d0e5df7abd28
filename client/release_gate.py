"""Every message a site answers passes its gate: the policy decides, the record remembers.

Before anything is computed, ``admit`` asks the site's policy (``starfed.client.policy``)
whether the request may be answered; a refusal is recorded with its reason and raised, so the
reply is an error the server records as a refusal by the site's policy. After the reply is
made, ``release`` refuses it when it is larger than the policy allows, else records what leaves
— classes, fields, bytes, the sha256 of the exact bytes, ε and δ spent per class — in the
site's release record (``starfed.client.release_record``) before it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from starfed.client.policy import PolicyRefusal, PrivacyTerms
from starfed.client.privacy import PrivateReleases
from starfed.client.release_record import Release, ReleaseRecord, now
from starfed.client.site import Site
from starfed.shared.privacy import accountant
from starfed.shared.protocol import reply_sha256


@dataclass(frozen=True)
class Request:
    """What one message asks of the site, as its policy and record see it."""

    run: int
    step: int
    phase: str  # the message's key: a phase's, or the catch-up's
    round: int
    federation: str
    wire_dtype: str
    releases: tuple[str, ...]  # what answering would release (``policy.releases_of``)
    server: str  # sha256 of the ca.pem the site trusts, its server ("": a simulation)

    def release(self, codebook_version: int, outgoing: tuple[Outgoing, ...] = ()) -> Release:
        """The record line of ``outgoing``, this request's reply (none: a refusal, whose
        reason the caller adds)."""
        sent = [(r.name, r.data) for r in outgoing]
        return Release(
            now(),
            self.server,
            self.federation,
            self.run,
            self.step,
            self.phase,
            self.round,
            codebook_version,
            classes=tuple(dict.fromkeys(c for r in outgoing for c in r.classes)),
            fields=tuple(dict.fromkeys(f for r in outgoing for f in r.fields)),
            bytes=sum(len(data) for _, data in sent),
            sha256=reply_sha256(sent) if sent else "",
        )


@dataclass(frozen=True)
class Outgoing:
    """One record of a reply: its name and bytes, and what of the site it carries."""

    name: str
    data: bytes
    classes: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()


def admit(site: Site, request: Request) -> None:
    """Refuse (``PolicyRefusal``, recorded) a request the site's policy forbids."""
    reason = refused(site, request)
    if reason is not None:
        raise PolicyRefusal(reason)


def refused(site: Site, request: Request) -> str | None:
    """Why the site's policy forbids ``request`` (the refusal recorded), None when it allows
    it: a phase travelling with a message the site answers is refused on its own."""
    setting = None if site.private is None else site.private.setting
    terms = (
        None
        if setting is None
        else PrivacyTerms(setting.epsilon, setting.delta, setting.unit.value)
    )
    reason = site.policy.refusal(
        request.releases, request.wire_dtype, request.federation, request.server, terms
    )
    if reason is not None:
        _record_refusal(site, request, reason)
    return reason


def release(
    site: Site, request: Request, records: list[Outgoing], codebook_version: int
) -> list[tuple[str, bytes]]:
    """The reply's records as they are sent, once recorded; a reply larger than the policy
    allows is refused instead (recorded)."""
    line = request.release(codebook_version, tuple(records))
    reason = site.policy.oversized(line.bytes)
    if reason is not None:
        refuse(site, request, reason, codebook_version)
    if site.private is not None:
        line = replace(line, privacy=_spent(site.private, line.classes))
    ReleaseRecord(site.memory.root).append(line)
    return [(r.name, r.data) for r in records]


def refuse(site: Site, request: Request, reason: str, codebook_version: int = 0) -> None:
    """Record the refusal, then raise it."""
    _record_refusal(site, request, reason, codebook_version)
    raise PolicyRefusal(reason)


def _record_refusal(site: Site, request: Request, reason: str, codebook_version: int = 0) -> None:
    line = replace(request.release(codebook_version), refused=reason)
    ReleaseRecord(site.memory.root).append(line)


def _spent(private: PrivateReleases, classes: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """ε and δ each class has spent so far, read from the site's privacy ledger: its releases
    composed at the releases' share of δ, as ``PrivateReleases.epsilon``, beside the whole δ
    (the other share is the class's announcement's, docs/security.md)."""
    ledger, setting = private.memory.ledger(), private.setting
    return {
        name: (
            accountant.epsilon(ledger.past(private.key(name, ledger)), setting.release_delta),
            setting.delta,
        )
        for name in classes
    }
