"""Access rules shared by mmrl's small HTTP servers (the reward server `mmrl reward serve`, the labelling page
`mmrl label`): which bind addresses only this machine can reach, and the shared token every request must carry,
compared in constant time."""

from __future__ import annotations

import hmac
import ipaddress
import os


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).strip("[]")).is_loopback
    except ValueError:
        return False


def token_from_env(token: str | None, env: str) -> str | None:
    """`token` if given, else the environment variable `env` (an empty value counts as unset)."""
    if token is None:
        token = os.environ.get(env) or None
    return token


def check_token(token: object, name: str = "token") -> None:
    """ValueError unless `token` is None (no check) or a non-empty printable string."""
    if token is not None and (not isinstance(token, str) or not token.strip() or not token.isprintable()):
        raise ValueError(f"{name} must be a non-empty printable string (or unset for no token check)")


class BearerToken:
    """The ``Authorization: Bearer <token>`` rule of a server: `matches` compares a whole header value (or a bare
    token, `bare=True`) with the expected one in constant time (hmac.compare_digest); no token = everything passes."""

    def __init__(self, token: str | None):
        self.token = token
        self._header = None if token is None else f"Bearer {token}".encode("utf-8")

    @property
    def required(self) -> bool:
        return self._header is not None

    def matches(self, value: str | None, bare: bool = False) -> bool:
        if self._header is None:
            return True
        given = (value or "").strip().encode("utf-8")
        return hmac.compare_digest(given, self.token.encode("utf-8") if bare else self._header)
