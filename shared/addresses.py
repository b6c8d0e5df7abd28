"""Network addresses as users type them (``HOST:PORT``, ``[IPv6]:PORT``): parsed and printed
in one place, for the operations commands and the inference device's codebook client alike.
Pure functions: nothing here opens a socket."""

from __future__ import annotations

import ipaddress


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); ValueError with one line otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if ":" in host and not text.startswith("["):
        raise ValueError(f"write IPv6 addresses in brackets, e.g. [::1]:9092, got {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is a bind-everywhere address (``0.0.0.0``, ``::``): something a server
    listens on, never an address anyone can dial."""
    return host in ("0.0.0.0", "::", "")


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
