"""What the SuperNode's output says, told to the site engineer: the known failure lines as one
clear line each (:data:`FAILURES`), the output copied to the log and the terminal
(:func:`pump`), and why a SuperNode that stopped itself was refused (:func:`self_stopped`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from starfed.client.ops.site_options import SiteOptions
from starfed.ops import clock, pki


@dataclass(frozen=True)
class Failure:
    """A log line that means the SuperNode cannot work, and what to tell the user."""

    pattern: re.Pattern[str]
    explain: Callable[[SiteOptions], str]


def _wrong_ca(o: SiteOptions) -> str:
    return (
        f"TLS: the server's certificate is not signed by {o.ca}; get the federation's ca.pem "
        "from the operator (or check that --server is the server's address)"
    )


def _wrong_name(o: SiteOptions) -> str:
    return (
        f"TLS: {o.server} is not a name in the server's certificate; use the address the "
        "operator gave you, or ask them to add it (`starfed server certs --renew-server`)"
    )


def _not_registered(o: SiteOptions) -> str:
    return (
        f"refused: this site's key ({o.fingerprint}) is not registered; send "
        f"{pki.public_key_path(o.key) if o.key else 'the public key'} to the operator: "
        f"`starfed server sites add {o.name} <that file>`"
    )


def _auth_mismatch(o: SiteOptions) -> str:
    return (
        "refused: the server requires SuperNode authentication and this SuperNode did not "
        "authenticate (start with --key, over TLS)"
    )


def _key_revoked(o: SiteOptions) -> str:
    return (
        f"the server stopped accepting this site's key ({o.fingerprint}), most likely because "
        "the operator removed the site; a removed key never returns: make a new one with "
        "`starfed site keygen` and send its .pub to the operator"
    )


#: Known failure lines of Flower 1.42's SuperNode, first match wins (docs/deployment.md).
FAILURES: tuple[Failure, ...] = (
    Failure(re.compile(r"Hostname mismatch|IP address mismatch"), _wrong_name),
    Failure(re.compile(r"CERTIFICATE_VERIFY_FAILED"), _wrong_ca),
    Failure(re.compile(r"\[code: 2004\]"), _not_registered),
    Failure(re.compile(r"\[code: 2001\]"), _auth_mismatch),
)
#: Flower's SuperNode answers a 401 (its key was unregistered) by sending itself SIGINT, so it
#: ends "gracefully" with code 0; when nobody told it to stop, that line means revocation.
SELF_STOP = re.compile(r"SuperNode terminated gracefully")


def pump(
    stream: IO[bytes],
    log: IO[str],
    echo: IO[str] | None,
    on_line: Callable[[str], str | None],
    local: re.Pattern[str] | None = None,
    shown: Callable[[str], str | None] = lambda line: None,
) -> None:
    """Copy a process's output line by line to the log, classifying it; ``on_line`` may add a
    line of ours after it. The terminal (``echo``) gets starfed's words only: those lines and
    what ``shown`` makes of a line (none of Flower's own, which stay in the log: its round
    numbers, its servers' addresses and its shutdown noise mean nothing to a site engineer).
    Lines ``local`` matches are about a local connection (the SuperExec's to its SuperNode),
    not the server: marked so in the log."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        note = on_line(line)
        ours = f"starfed: {note}\n" if note else ""
        is_local = local is not None and local.search(line) is not None
        told = shown(line)
        try:
            write(log, (f"(local SuperExec, not the server) {line}" if is_local else line) + ours)
            if echo is not None and (told or ours):
                write(echo, (f"{told}\n" if told else "") + ours)
        except (OSError, ValueError):  # closed after we gave up waiting: drop the rest
            return


def write(out: IO[str], text: str) -> None:
    out.write(text)
    out.flush()


def self_stopped(options: SiteOptions, offset_s: float | None = None) -> str:
    """Why the SuperNode stopped itself (Flower's 401): a clock outside Flower's window, told
    apart from a removed key by asking the server's time (``ops.clock``); else the key.
    ``offset_s``: the measured difference (tests)."""
    if offset_s is None:
        offset_s = clock.server_offset(options.server, options.ca, options.insecure)
    if offset_s is not None and clock.refused(offset_s):
        return (
            "refused for clock skew, not for the key: Flower answered 401 (Invalid SuperNode "
            f"authentication) and {clock.describe(offset_s)}; set this machine's clock right "
            "(NTP) and start again"
        )
    return _key_revoked(options)
