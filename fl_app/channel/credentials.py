"""Per-call credentials for the served weight store (fl_app/channel/http_server.py).

Data owners do not trust each other, so one token for the whole run (which let any node delete
a checkpoint, overwrite the next round's global model or read another client's update) is not
enough. The ServerApp keeps a random secret that never leaves its process and, for every message
it sends, mints a credential naming what that one call may do:

    fa1.<payload>.<signature>
    payload    base64url (no padding) of compact JSON:
               {"run": 7, "round": 3, "client": 12, "node": 4711,
                "read": ["rounds/round-0002/actor"],
                "write": ["rounds/round-0003/clients/client-0012/actor"],
                "exp": 1796580000}
    signature  base64url of HMAC-SHA256(secret, "fa1." + payload)

`read` lists the entries the call may fetch (the global weights it names, and its own
uploads), `write` the keys it may publish under (only that client's uploads of that round; for
the init call, its export) and delete (its own upload, nothing else). `client` is null for a
call that is not a fit. `exp` (Unix seconds, the server's clock: only the server mints and
checks) is the call's TTL plus a margin. The store checks the signature in constant time before
it looks at anything else; a node cannot widen its scope without the secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

from fl_app.channel.store import check_key
from fl_app.weights import WeightsError

PREFIX = "fa1"
MARGIN_S = 60.0  # on top of the call's TTL: a reply still in flight when the TTL ends may finish its upload
MAX_CHARS = 16 << 10  # a credential longer than this is refused before it is decoded


class CredentialError(WeightsError):
    """A credential that is missing, malformed, forged, for another run, or expired (HTTP 401)."""


@dataclass(frozen=True)
class Grant:
    """What one verified credential allows."""

    run: int
    round: int
    client: int | None
    node: int
    read: frozenset[str]
    write: frozenset[str]
    exp: float

    def who(self) -> str:
        """The holder, for refusals: `client 12 (round 3, node 4711)`."""
        holder = f"client {self.client}" if self.client is not None else "a non-fit call"
        return f"{holder} (round {self.round}, node {self.node})"

    def may_read(self, key: str) -> bool:
        return key in self.read or key in self.write

    def may_write(self, key: str) -> bool:
        return key in self.write


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Issuer:
    """Mints and verifies one run's credentials; the secret stays in this object (the ServerApp's
    process), so only the server can grant anything."""

    def __init__(self, run_id: int, secret: bytes | None = None, margin_s: float = MARGIN_S) -> None:
        self.run_id, self.margin_s = run_id, margin_s
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        if len(self._secret) < 32:
            raise WeightsError("a credential secret needs >= 32 random bytes (leave it out: Issuer makes one)")

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, f"{PREFIX}.{payload}".encode(), hashlib.sha256).digest())

    def mint(
        self,
        *,
        round: int,
        client: int | None,
        node: int,
        read: Iterable[str] = (),
        write: Iterable[str] = (),
        ttl_s: float,
    ) -> str:
        """A credential for one call; every key is checked (`check_key`) so a grant names entries only."""
        if not ttl_s > 0:
            raise WeightsError(f"a credential needs a positive lifetime, got ttl_s={ttl_s}")
        body = {
            "run": self.run_id,
            "round": round,
            "client": client,
            "node": node,
            "read": sorted({check_key(k) for k in read}),
            "write": sorted({check_key(k) for k in write}),
            "exp": math.ceil(time.time() + ttl_s + self.margin_s),  # never shorter than asked
        }
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{PREFIX}.{payload}.{self._sign(payload)}"

    def verify(self, credential: str) -> Grant:
        """The grant `credential` carries; `CredentialError` naming why it is refused otherwise."""
        parts = credential.split(".") if len(credential) <= MAX_CHARS else []
        if len(parts) != 3 or parts[0] != PREFIX:
            raise CredentialError(
                "no weight-store credential of this run (expected 'Bearer fa1.<payload>.<signature>', "
                "the token the ServerApp put in this call)"
            )
        if not hmac.compare_digest(self._sign(parts[1]).encode(), parts[2].encode()):
            raise CredentialError(
                "the weight-store credential's signature does not match: it was altered, or minted by "
                "another run's ServerApp (use the token of the call being served)"
            )
        try:
            body = json.loads(_unb64(parts[1]))
            grant = Grant(
                run=int(body["run"]),
                round=int(body["round"]),
                client=None if body["client"] is None else int(body["client"]),
                node=int(body["node"]),
                read=frozenset(map(str, body["read"])),
                write=frozenset(map(str, body["write"])),
                exp=float(body["exp"]),
            )
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CredentialError(f"the weight-store credential's payload is malformed ({e})") from None
        if grant.run != self.run_id:
            raise CredentialError(
                f"the weight-store credential is for run {grant.run}, this store serves run {self.run_id}"
            )
        if time.time() > grant.exp:
            raise CredentialError(
                f"the weight-store credential of {grant.who()} expired {time.time() - grant.exp:.0f} s ago "
                "(it lives as long as its call): the server has given up on that call"
            )
        return grant
