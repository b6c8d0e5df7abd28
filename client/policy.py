"""The site's policy: what it will release and to whom, whatever the server asks.

A hospital's governance office decides what may leave the site, not the operator
(docs/sites.md#for-a-governance-office). The policy is one TOML file — ``policy.toml`` in the
state folder, where ``starfed site start --policy FILE`` copies its file — read when the site
starts and once per site process, parsed into a ``SitePolicy``; every item's default is what a
site without a policy does. The site applies it in two places:

* its data: classes the policy does not admit (deny and allow globs, too few images or
  patients) are not in the folder as the site sees it (``site.admitted``), so they are never
  announced, trained on, or evaluated;
* each message, before anything is computed (``refusal``): a request it would break — another
  federation or server, a wire dtype, a field it withholds, a privacy setting weaker than
  required — is refused with one reason; a reply larger than allowed is refused before it is
  sent (``oversized``). The server records a refusal by the site's policy, not a failure.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starfed.shared.codebook import schema
from starfed.shared.protocol import POLICY_REFUSED, Phase

#: In the state folder: the policy in force (``site start --policy`` copies its file there),
#: and the sha256 of the ca.pem the site trusts (``site start`` writes it; none in a
#: simulation): what the site's ClientApp reads.
POLICY_FILE = "policy.toml"
SERVER_FILE = "server-certificate"
#: What a sync releases (class names and image counts) and what an evaluation does (counts of
#: right answers, and of test images taken by the newest step's classes of other sites): the
#: names the policy withholds them by, beside the codebook's fields.
COUNTS, EVALUATION = "counts", "evaluation"
RELEASES = (COUNTS, *(f.name for f in schema.FIELDS if f.trained_in is not None), EVALUATION)
WIRE_DTYPES = ("float32", "float16")
PRIVACY_UNITS = ("image", "patient")


class PolicyError(ValueError):
    """A policy file the site cannot follow: one line naming the key."""


class PolicyRefusal(RuntimeError):
    """A request the policy forbids: the reply is this error, whose text the server reads as a
    refusal by the site's policy (``POLICY_REFUSED``) with its one reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{POLICY_REFUSED}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class PrivacyTerms:
    """What a site's privacy setting promises for a run: its target ε and δ, and the unit."""

    epsilon: float
    delta: float
    unit: str  # "image" or "patient"


@dataclass(frozen=True)
class SitePolicy:
    """What the site releases, and to whom. Defaults: everything, to anyone (today's site)."""

    allow: tuple[str, ...] = ("*",)  # class names or globs the site may announce
    deny: tuple[str, ...] = ()  # ... and may never, whatever ``allow`` says
    min_images: int = 0  # a class announced has at least this many (patients: patient unit)
    privacy_required: bool = False
    max_epsilon: float = math.inf  # the largest target ε the site releases under
    max_delta: float = 1.0
    privacy_unit: str = ""  # "image" or "patient": the unit the site's ε must protect
    withhold: tuple[str, ...] = ()  # of ``RELEASES``: what never leaves
    wire_dtypes: tuple[str, ...] = WIRE_DTYPES  # the dtypes its updates may travel in
    max_reply_bytes: int = 0  # 0: no limit
    server_certificate: str = ""  # sha256 of the ca.pem of the server it answers ("": any)
    federation: str = ""  # the federation it answers ("": any)

    # --- the file ---------------------------------------------------------------------------

    @classmethod
    def read(cls, path: Path) -> SitePolicy:
        """The policy in ``path`` (``PolicyError``: one line naming the file and the key)."""
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise PolicyError(f"policy {path}: {err}") from None
        try:
            return cls.from_toml(raw)
        except PolicyError as err:
            raise PolicyError(f"policy {path}: {err}") from None

    @classmethod
    def from_toml(cls, raw: Mapping[str, Any]) -> SitePolicy:
        """The policy from a parsed TOML document: sections and keys of ``KEYS`` only."""
        values: dict[str, Any] = {}
        for section, table in raw.items():
            if not isinstance(table, dict):
                raise PolicyError(f"{section}: expected a [{section}] table")
            for key, value in table.items():
                if (section, key) not in KEYS:
                    raise PolicyError(f"{section}.{key}: unknown key (known: {_known()})")
                attribute, parse = KEYS[(section, key)]
                try:
                    values[attribute] = parse(value)
                except (TypeError, ValueError) as err:
                    raise PolicyError(f"{section}.{key}: {err}") from None
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The policy in force, by its file's keys (``starfed site check``, the record)."""
        return {f"{s}.{k}": _plain(getattr(self, a)) for (s, k), (a, _) in KEYS.items()}

    # --- the data ---------------------------------------------------------------------------

    @property
    def filters_classes(self) -> bool:
        """Whether the policy leaves any class out (the default leaves none)."""
        return self.allow != ("*",) or bool(self.deny) or self.min_images > 0

    def admits(self, name: str) -> bool:
        """Whether class ``name`` may be announced by its name: allowed, not denied (globs,
        matched without regard to case)."""
        allow, deny = self._globs
        return bool(allow.fullmatch(name)) and not (deny and deny.fullmatch(name))

    @functools.cached_property
    def _globs(self) -> tuple[re.Pattern[str], re.Pattern[str] | None]:
        """``allow`` and ``deny`` as one pattern each (None: nothing denied), compiled once:
        a folder of 10,000 classes is read at every message."""
        return _pattern(self.allow), _pattern(self.deny) if self.deny else None

    # --- the messages -----------------------------------------------------------------------

    def refusal(
        self,
        releases: tuple[str, ...],
        wire_dtype: str,
        federation: str,
        server_certificate: str,
        privacy: PrivacyTerms | None,
    ) -> str | None:
        """Why a message asking for ``releases`` must be refused (None: it may be answered)."""
        if self.federation and federation != self.federation:
            return f"pinned to federation {self.federation}, asked by {federation or 'none'}"
        if self.server_certificate and server_certificate != self.server_certificate:
            return f"pinned to server certificate {self.server_certificate[:16]}…, not this one"
        forbidden = [name for name in releases if name in self.withhold]
        if forbidden:
            return f"release.withhold forbids {', '.join(forbidden)}"
        if wire_dtype not in self.wire_dtypes:
            return f"wire dtype {wire_dtype} not in release.wire-dtypes {list(self.wire_dtypes)}"
        return self._privacy_refusal(privacy) if releases else None

    def _privacy_refusal(self, privacy: PrivacyTerms | None) -> str | None:
        if privacy is None:
            required = "privacy.required: this run releases without privacy"
            return required if self.privacy_required else None
        if privacy.epsilon > self.max_epsilon:
            return f"privacy epsilon {privacy.epsilon:g} > privacy.max-epsilon {self.max_epsilon:g}"
        if privacy.delta > self.max_delta:
            return f"privacy delta {privacy.delta:g} > privacy.max-delta {self.max_delta:g}"
        if self.privacy_unit and privacy.unit != self.privacy_unit:
            return f"privacy unit {privacy.unit} is not privacy.unit {self.privacy_unit}"
        return None

    def oversized(self, size: int) -> str | None:
        """Why a reply of ``size`` bytes must not be sent (None: it may)."""
        if self.max_reply_bytes and size > self.max_reply_bytes:
            return f"reply of {size} bytes > release.max-reply-bytes {self.max_reply_bytes}"
        return None


def releases_of(phase: Phase, travelling: Sequence[Phase]) -> tuple[str, ...]:
    """What a message of ``phase`` asks the site to release (``travelling``: the phases travelling
    with it): counts at the sync, the phase's fields, the evaluation (a catch-up part, which is
    no phase, releases nothing)."""
    if phase is Phase.SYNC:
        return (COUNTS,)
    if phase is Phase.EVALUATE:
        return (EVALUATION,)
    return tuple(name for p in (phase, *travelling) for name in schema.trained_in(p))


def read_policy(path: Path | None, state_dir: Path) -> SitePolicy:
    """The site's policy: ``path``'s, else its state folder's ``policy.toml``, else the
    default (every item today's behaviour)."""
    path = path or state_dir / POLICY_FILE
    return SitePolicy.read(path) if path.is_file() else SitePolicy()


def server_certificate(state_dir: Path) -> str:
    """The sha256 of the ca.pem the site trusts ("": none recorded, a simulation)."""
    path = state_dir / SERVER_FILE
    return path.read_text().strip() if path.is_file() else ""


# --- the file's keys: one row each --------------------------------------------------------------


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TypeError("expected a list of names")
    return tuple(value)


def _one_of(choices: tuple[str, ...]) -> Callable[[object], tuple[str, ...]]:
    def parse(value: object) -> tuple[str, ...]:
        names = _names(value)
        wrong = [name for name in names if name not in choices]
        if wrong:
            raise ValueError(f"{wrong[0]!r} is none of {', '.join(choices)}")
        return names

    return parse


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("expected a whole number, 0 or more")
    return value


def _positive(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise TypeError("expected a number above 0")
    return float(value)


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError("expected true or false")
    return value


def _unit(value: object) -> str:
    if value not in PRIVACY_UNITS:
        raise ValueError(f"expected one of {', '.join(PRIVACY_UNITS)}")
    return str(value)


def _sha256(value: object) -> str:
    text = str(value).lower().removeprefix("sha256:").replace(":", "")
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError("expected a sha256 in hex (sha256sum ca.pem)")
    return text


def _text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError("expected a non-empty string")
    return value


#: (section, key) in the file -> (``SitePolicy`` attribute, parser of its value).
KEYS: dict[tuple[str, str], tuple[str, Callable[[object], Any]]] = {
    ("classes", "allow"): ("allow", _names),
    ("classes", "deny"): ("deny", _names),
    ("classes", "min-images"): ("min_images", _count),
    ("privacy", "required"): ("privacy_required", _flag),
    ("privacy", "max-epsilon"): ("max_epsilon", _positive),
    ("privacy", "max-delta"): ("max_delta", _positive),
    ("privacy", "unit"): ("privacy_unit", _unit),
    ("release", "withhold"): ("withhold", _one_of(RELEASES)),
    ("release", "wire-dtypes"): ("wire_dtypes", _one_of(WIRE_DTYPES)),
    ("release", "max-reply-bytes"): ("max_reply_bytes", _count),
    ("server", "certificate-sha256"): ("server_certificate", _sha256),
    ("server", "federation"): ("federation", _text),
}


def _known() -> str:
    return ", ".join(f"{s}.{k}" for s, k in KEYS)


def _pattern(globs: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs), re.IGNORECASE)


def _plain(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    return None if value == math.inf else value
