"""Clock skew between a site and the server: measured, never guessed from a refusal.

Flower signs every Fleet API call of a SuperNode with the site's current time and refuses one
whose age on the server's clock is outside a window (1.42: more than 5 s in the future or 305 s
in the past) — with the same 401 "Invalid SuperNode authentication" as a removed key, after
which the SuperNode stops itself. A site whose clock runs 30 s fast was therefore told that the
operator removed it. Both sides now measure the difference instead:

- the gateway (``server.ops.gateway``) sees every call's signed timestamp; when the SuperLink
  answers 401 to a call whose timestamp is outside the window it logs one ``clock skew`` line
  with the difference and the key, which ``starfed server sites refused`` shows;
- a site whose SuperNode stopped itself asks the gateway for its ``Date`` (any reply has one)
  and compares it with its own clock (``server_offset``): outside the window, the site is told
  to set its clock right, not to make a new key.
"""

from __future__ import annotations

import datetime
import email.utils
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

SKEW_LINE = "clock skew"  # what the gateway's log line says (``sites.refused`` reads it)


def limits() -> tuple[float, float]:
    """(ahead, behind): a site clock at least ``ahead`` seconds ahead of the server's, or
    ``behind`` seconds behind it, is refused. Flower's constants, imported only when asked
    (a command that fails on bad input answers before Flower is imported)."""
    from starfed.ops.flower_internals import SYSTEM_TIME_TOLERANCE, TIMESTAMP_TOLERANCE

    return float(SYSTEM_TIME_TOLERANCE), float(TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE)


def refused(offset_s: float) -> bool:
    """Whether Flower refuses a site whose clock is ``offset_s`` seconds ahead of the server's
    (negative: behind)."""
    ahead, behind = limits()
    return offset_s >= ahead or offset_s <= -behind


def describe(offset_s: float) -> str:
    """One phrase: how far off, which way, and what Flower accepts."""
    ahead, behind = limits()
    way = "ahead of" if offset_s > 0 else "behind"
    return (
        f"the site's clock is {abs(offset_s):.0f} s {way} the server's (Flower accepts at most "
        f"{ahead:.0f} s ahead, {behind:.0f} s behind)"
    )


def signed_offset(timestamp: str, now: datetime.datetime | None = None) -> float | None:
    """Seconds a signed timestamp (ISO 8601, as the SuperNode sends it) is ahead of ``now``
    (the server's clock); None when it does not parse."""
    try:
        signed = datetime.datetime.fromisoformat(timestamp)
    except (TypeError, ValueError):
        return None
    if signed.tzinfo is None:
        signed = signed.replace(tzinfo=datetime.UTC)
    return (signed - (now or datetime.datetime.now(datetime.UTC))).total_seconds()


def server_offset(
    server: str, ca: Path | None, insecure: bool, timeout_s: float = 10.0
) -> float | None:
    """Seconds this machine's clock is ahead of the server's, from the ``Date`` of any reply of
    the gateway at ``server`` (HOST:PORT; it answers 403 to a GET, with a date); None when it
    cannot be reached or sends no date. ``Date`` has whole seconds: the result is at most 1 s
    too large."""
    url = f"{'http' if insecure else 'https'}://{server}/"
    context = None if insecure else ssl.create_default_context(cafile=str(ca) if ca else None)
    before = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
            date = reply.headers.get("Date")
    except urllib.error.HTTPError as err:  # the gateway's 403: an answer all the same
        date = err.headers.get("Date")
    except (OSError, ValueError):
        return None
    after = time.time()
    try:
        server_time = email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None
    return None if server_time is None else (before + after) / 2 - server_time
