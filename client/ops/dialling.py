"""Whether a site's SuperNode reaches the server, said where its operator looks.

Flower's SuperNode retries an unreachable server for ever, and its log says only "Connection
attempt failed, retrying in 9.84 seconds" — never the address it dials; the site's SuperExec
logs "Connection successful after 1.63 seconds" for its own local connection, which reads as if
the server had answered. ``site start`` reads the SuperNode's log through :class:`Dialling`: the
first failed attempt becomes one line naming the address, then one line a minute while it
lasts, one line when it is reached; a site that has not reached its server once since it
started gives up after ``--give-up-after`` seconds (a wrong address or port is the usual
reason), with exit code 1. Once reached, it retries for as long as the server is away: a
server restarts, a site is a service. docs/deployment.md, "A site that cannot reach the server".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The SuperNode's own lines (Flower 1.42, ``flwr.supercore.retry.http_retry``).
RETRYING = re.compile(r"Connection attempt failed, retrying in")
RECONNECTED = re.compile(r"Connection successful after")
#: The SuperNode registered with the SuperLink: the server was reached.
REACHED = re.compile(r"SuperNode ID: |Connection successful after")
#: The SuperNode's first answer from the server: it has joined.
JOINED = re.compile(r"SuperNode ID: (\d+)")
#: Flower's retry lines of the site's own SuperExec (a local connection), not the server's.
LOCAL_RETRY = re.compile(r"Connection (attempt failed|successful after)")
GIVE_UP_S = 300.0  # `site start --give-up-after`: before the server was reached once
REPEAT_S = 60.0  # while it cannot reach the server, one line a minute


@dataclass
class Dialling:
    """What the SuperNode's log says about reaching ``server``, as lines for its operator."""

    server: str
    give_up_s: float = GIVE_UP_S  # 0: never
    site: str = ""  # the name it joins as
    reached: bool = False
    failing_since: float | None = None
    said_at: float = 0.0

    def see(self, line: str, now: float) -> str | None:
        """The line to tell the operator about this SuperNode log line, if any."""
        if REACHED.search(line):
            first, self.reached = not self.reached, True
            if self.failing_since is not None and RECONNECTED.search(line):
                since, self.failing_since = self.failing_since, None
                return f"reached the server at {self.server} after {now - since:.0f} s of retries"
            self.failing_since = None
            if first and (joined := JOINED.search(line)):
                return (
                    f"joined the server at {self.server} as {self.site} (node {joined[1]}); "
                    "waiting for a step"
                )
            return None
        if not RETRYING.search(line):
            return None
        if self.failing_since is None:
            self.failing_since = self.said_at = now
            return (
                f"cannot reach the server at {self.server} (nothing answers there, or a "
                f"proxy refused); retrying{self._until()}"
            )
        if now - self.said_at >= REPEAT_S:
            self.said_at = now
            return (
                f"still cannot reach the server at {self.server} after "
                f"{now - self.failing_since:.0f} s{self._until()}"
            )
        return None

    def gave_up(self, now: float) -> str | None:
        """Why the site stops, once it has tried for ``give_up_s`` without ever reaching it."""
        if self.reached or not self.give_up_s or self.failing_since is None:
            return None
        if now - self.failing_since < self.give_up_s:
            return None
        return (
            f"gave up: could not reach the server at {self.server} in {self.give_up_s:.0f} s; "
            "check --server (the HOST:PORT the operator's `server start` printed) and that the "
            "server runs (--give-up-after 0: keep trying)"
        )

    def _until(self) -> str:
        if self.reached or not self.give_up_s:
            return " until it answers"
        return f"; gives up {self.give_up_s:.0f} s after the first failure (--give-up-after)"
