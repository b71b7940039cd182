"""Who is calling, as the cache engine sees it: the tenant (authenticated by promptcache.sidecar.auth) and the
connection it came on. No transport here: the gRPC servicer and the bulk channel both build a `Caller`."""
from __future__ import annotations

import re
from dataclasses import dataclass

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")


@dataclass(frozen=True)
class Identity:
    tenant: str      # "" for anonymous callers (auth off)
    method: str      # "none", "token" or "mtls"

    @property
    def anonymous(self) -> bool:
        return self.method == "none"


ANONYMOUS = Identity("", "none")


def check_tenant_name(name: str, where: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}: tenant name {name!r} must be 1-128 characters of letters, digits, "
                         "'.', '_', '@' and '-', starting with a letter or digit")
    return name


def client_key(identity: Identity, peer: str) -> str:
    """Who a call counts against: the authenticated tenant, or the peer address (a connection) without auth."""
    return f"tenant:{identity.tenant}" if not identity.anonymous else f"peer:{peer}"


@dataclass(frozen=True)
class Caller:
    """One request's caller: its identity, its connection (`peer`) and, when it said so, its inference pod
    (`pod`, the gRPC metadata x-promptcache-pod: KV events for its models go to that pod's topic)."""
    identity: Identity
    peer: str = ""
    pod: str = ""

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def client(self) -> str:
        return client_key(self.identity, self.peer)

