"""Tenancy: which key namespace a call reads and writes, and how many bytes each tenant may hold.

With authentication on, the client's Model.tenant_salt never reaches the fingerprint as sent. The server
replaces it with HMAC-SHA256(server secret, tenant, client salt): a tenant can subdivide its own namespace,
but cannot name, guess or collide with another tenant's, so lookups, gets, puts (skipped vs stored), deletes
and purges of one tenant never touch another's chunks — every such call takes the same code path as a plain
miss. A client salt of the form `share:GROUP` selects an opt-in sharing group instead (a public system prompt):
every member of the group reads and writes the group's namespace, salted with HMAC(secret, group). Groups and
their members are configuration (--sharing-groups "public=*;team-a=alice,bob").

Quotas: every stored chunk is charged to its owner (the tenant, or the sharing group) in this layer, from the
store's own entries (its eviction callback tells when bytes leave). A Put that would take its owner over quota
first evicts the owner's least recently used chunks (never another tenant's); if the owner's bytes are all held
by Puts in flight, the chunk is refused with RESOURCE_EXHAUSTED. A chunk promoted from the disk tier is charged
too (charge_if_room): when its owner has no room it is served from disk and not promoted (tiers/stack.py).

With authentication off every caller is the anonymous tenant and the client's salt is used as sent (the
behaviour of docs/keys.md).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from promptcache.sidecar.identity import Identity, check_tenant_name

log = logging.getLogger("promptcache.sidecar.tenancy")

SHARE_PREFIX = b"share:"
_SALT_DOMAIN = b"promptcache/tenant-salt/v1\x00"


class TenancyError(Exception):
    """code: 'permission' (PERMISSION_DENIED), 'quota' (RESOURCE_EXHAUSTED) or 'invalid' (INVALID_ARGUMENT)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def parse_groups(text: str) -> dict[str, frozenset[str] | None]:
    """'public=*;team-a=alice,bob' -> {'public': None (everyone), 'team-a': {'alice', 'bob'}}."""
    groups: dict[str, frozenset[str] | None] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, members = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--sharing-groups: {part!r} is not GROUP=MEMBER,MEMBER or GROUP=*")
        check_tenant_name(name, "--sharing-groups")
        names = [m.strip() for m in members.split(",") if m.strip()]
        if names == ["*"]:
            groups[name] = None
        else:
            if not names:
                raise ValueError(f"--sharing-groups: group {name!r} has no members")
            groups[name] = frozenset(check_tenant_name(m, f"--sharing-groups {name}") for m in names)
    return groups


def parse_quotas(text: str) -> dict[str, int]:
    """'alice=1Gi,group:public=256Mi' -> {'alice': 1073741824, 'group:public': 268435456}."""
    from promptcache.sidecar.config import parse_bytes

    quotas = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        owner, sep, amount = part.partition("=")
        if not sep:
            raise ValueError(f"--tenant-quotas: {part!r} is not TENANT=BYTES")
        owner = owner.strip()
        name = owner[len("group:"):] if owner.startswith("group:") else owner
        check_tenant_name(name, "--tenant-quotas")
        try:
            quotas[owner] = parse_bytes(amount.strip())
        except ValueError as exc:
            raise ValueError(f"--tenant-quotas {owner}: {exc}") from None
    return quotas


def load_secret(path: str) -> bytes:
    if not path:
        return secrets.token_bytes(32)
    from promptcache.client.credentials import read_credential

    secret = read_credential(path, "--tenant-secret-file").strip()  # bounded; a FIFO or /dev/zero is refused
    if len(secret) < 16:
        raise ValueError(f"--tenant-secret-file {path} holds {len(secret)} bytes; at least 16 are needed")
    return secret


@dataclass
class _Usage:
    used: int = 0
    reserved: int = 0
    entries: OrderedDict = field(default_factory=OrderedDict)  # key -> Entry, least recently used first
    hit_tokens: int = 0
    missed_tokens: int = 0


class Tenancy:
    def __init__(self, *, enabled: bool, secret: bytes | None = None, groups: dict | None = None,
                 admins: frozenset[str] = frozenset(), default_quota: int = 0, quotas: dict | None = None,
                 isolate: bool | None = None, tier=None, tenants: frozenset[str] = frozenset()):
        self.enabled = enabled  # callers are authenticated tenants (admins, per-tenant quotas and stats)
        self.isolate = enabled if isolate is None else isolate and enabled  # tenants' keys are salted apart
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        self.groups = groups or {}
        self.admins = admins
        self.default_quota = default_quota
        self.quotas = quotas or {}
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}
        self._owner_of: dict[bytes, str] = {}
        self.tier = tier  # the memory tier: a Put over quota evicts the owner's own chunks from it
        self.tenants = tenants  # the tenants configured by name (the token file's at start); see knows()

    @classmethod
    def from_settings(cls, settings, tier=None) -> "Tenancy":
        enabled = settings.authenticated  # --tenancy isolated without it is refused by Settings.validate
        mode = settings.tenancy
        if settings.tenant_secret_file:
            secret = load_secret(settings.tenant_secret_file)
        else:
            secret = secrets.token_bytes(32)
            if enabled and settings.disk_bytes:
                log.warning("no --tenant-secret-file: tenant salts change on every restart, so chunks kept on "
                            "disk across a restart will not be found again")
        admins = frozenset(check_tenant_name(a.strip(), "--admin-tenants")
                           for a in settings.admin_tenants.split(",") if a.strip())
        return cls(enabled=enabled, secret=secret, groups=parse_groups(settings.sharing_groups), admins=admins,
                   default_quota=settings.tenant_quota_bytes, quotas=parse_quotas(settings.tenant_quotas),
                   isolate=mode != "shared", tier=tier, tenants=_token_tenants(settings.token_file))

    # --- namespaces -------------------------------------------------------------------------------------
    def namespace(self, identity: Identity, client_salt: bytes) -> tuple[bytes, str]:
        """(salt to hash into the fingerprint, owner charged for the chunks)."""
        if not self.isolate:  # one shared namespace (auth off, or --tenancy shared): the client's salt as is
            return client_salt, ""
        if client_salt.startswith(SHARE_PREFIX):
            group = client_salt[len(SHARE_PREFIX):].decode("utf-8", "replace")
            members = self.groups.get(group, frozenset())
            if group not in self.groups or (members is not None and identity.tenant not in members):
                raise TenancyError("permission", f"tenant {identity.tenant!r} is not a member of sharing group "
                                                 f"{group!r} (--sharing-groups)")
            return self._mac(b"group\x00" + group.encode()), "group:" + group
        tenant = identity.tenant.encode()
        return self._mac(b"tenant\x00" + len(tenant).to_bytes(2, "little") + tenant + client_salt), identity.tenant

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self.secret, _SALT_DOMAIN + message, hashlib.sha256).digest()

    def knows(self, owner: str) -> bool:
        """Whether `owner` is one this sidecar can charge chunks to without having been told by a caller: "" (the
        shared namespace), a configured sharing group ("group:NAME"), or, with tenants isolated, a tenant it
        knows (the token file's at start, --tenant-quotas, --admin-tenants, a group's members, or one that has
        called). A peer's hot list naming any other owner is not followed (warm-up)."""
        if owner == "":
            return True
        if not self.isolate:
            return False  # every chunk is the shared namespace's
        if owner.startswith("group:"):
            return owner[len("group:"):] in self.groups
        if owner in self.tenants or owner in self.quotas or owner in self.admins:
            return True
        if any(members is not None and owner in members for members in self.groups.values()):
            return True
        with self._lock:
            return owner in self._usage

    def is_admin(self, identity: Identity) -> bool:
        return not self.enabled or identity.tenant in self.admins

    # --- quotas -----------------------------------------------------------------------------------------
    def quota(self, owner: str) -> int:
        return self.quotas.get(owner, self.default_quota)

    def _usage_of(self, owner: str) -> _Usage:
        u = self._usage.get(owner)
        if u is None:
            u = self._usage[owner] = _Usage()
        return u

    def _accounted(self, nbytes: int) -> int:
        # as the store charges a chunk (entry.accounted, what inserted() adds)
        return nbytes if self.tier is None else self.tier.accounted(nbytes)

    def reserve(self, owner: str, nbytes: int, fingerprint: bytes) -> int:
        """Charge a chunk about to be received to `owner`; evict the owner's own LRU chunks to make room.
        Returns the bytes charged: give them back with release() once the chunk is committed or dropped (a
        committed chunk is charged to its owner by the store's insert hook)."""
        need = self._accounted(nbytes)
        limit = self.quota(owner)
        for _ in range(64):
            with self._lock:
                u = self._usage_of(owner)
                if not limit or u.used + u.reserved + need <= limit:
                    u.reserved += need
                    return need
                if need > limit:
                    raise TenancyError("quota", f"a chunk of {nbytes} bytes exceeds the quota of {limit} bytes "
                                                f"of {owner or 'the anonymous tenant'}")
                victims, freed = [], 0
                # its oldest first, its pinned ones (a priority hint) only when the others are not enough. The
                # pinned ones passed over go to the recent end, so the next chunk's walk does not pass them again:
                # it ran under this lock, which every tenant's calls take, and an owner whose oldest entries were
                # pinned (up to --max-pinned-fraction of its quota) paid O(pinned) per chunk (37 ms at 100k pinned
                # chunks). The unpinned entries keep their order; the pinned ones are taken after them anyway.
                skipped = []
                for entry in u.entries.values():
                    if u.used + u.reserved + need - freed <= limit:
                        break
                    if entry.pinned:
                        skipped.append(entry.key)
                        continue
                    victims.append(entry)
                    freed += entry.accounted
                if u.used + u.reserved + need - freed > limit:  # not enough: the pinned ones, oldest first
                    skipped = []
                    for entry in u.entries.values():
                        if u.used + u.reserved + need - freed <= limit:
                            break
                        if entry.pinned:
                            victims.append(entry)
                            freed += entry.accounted
                for key in skipped:
                    u.entries.move_to_end(key)
            if not victims:
                raise TenancyError("quota", f"quota of {limit} bytes of {owner or 'the anonymous tenant'} is held "
                                            "by Puts in flight; retry later")
            for entry in victims:
                self.tier.delete([entry.key], entry.fingerprint, reason="quota")
        raise TenancyError("quota", f"could not make room within the quota of {owner}")

    def charge_if_room(self, owner: str, nbytes: int) -> int | None:
        """Charge a chunk promoted from disk to `owner` if it fits in the quota as it is (nothing is evicted);
        None when it does not. Give the bytes returned back with release() after the commit."""
        need = self._accounted(nbytes)
        limit = self.quota(owner)
        with self._lock:
            u = self._usage_of(owner)
            if limit and u.used + u.reserved + need > limit:
                return None
            u.reserved += need
            return need

    def release(self, owner: str, charged: int) -> None:
        if charged:
            with self._lock:
                self._usage_of(owner).reserved -= charged
                self._forget_if_empty(owner)

    def _forget_if_empty(self, owner: str) -> None:
        """Under the lock: drop `owner`'s usage once it holds, reserves and counted nothing (its quota is
        configuration, not usage: nothing is lost), so owners that come and go do not grow it or /metrics."""
        u = self._usage.get(owner)
        if u is not None and not (u.used or u.reserved or u.entries or u.hit_tokens or u.missed_tokens):
            del self._usage[owner]

    # --- the store's hooks (promptcache.sidecar.store.StoreListener) ---------------------------------------
    def inserted(self, entry) -> None:
        """Called by the store (under its lock) for every chunk stored: it now counts as its owner's. The
        charge reserved for it is given back by release() after the commit."""
        with self._lock:
            if entry.key in self._owner_of:
                return
            u = self._usage_of(entry.owner)
            self._owner_of[entry.key] = entry.owner
            u.entries[entry.key] = entry
            u.used += entry.accounted

    def removed(self, entry, reason: str = "", age: float = 0.0) -> None:
        """Called by the store (under its lock) for every entry removed, whatever the reason."""
        with self._lock:
            owner = self._owner_of.get(entry.key)
            if owner is None:
                return
            u = self._usage[owner]
            if u.entries.get(entry.key) is not entry:
                return
            del self._owner_of[entry.key]
            del u.entries[entry.key]
            u.used -= entry.accounted
            self._forget_if_empty(owner)

    def touched(self, owner: str, key: bytes) -> None:
        with self._lock:
            u = self._usage.get(owner)
            if u is not None and key in u.entries:
                u.entries.move_to_end(key)

    # Reads (promptcache.sidecar.store.ReadListener): each owner's hit counts, and its chunks' recency.
    def looked_up(self, rpc: str, owner: str, cached: int, total: int, by_tier: dict[str, int]) -> None:
        with self._lock:
            u = self._usage_of(owner)
            u.hit_tokens += cached
            u.missed_tokens += total - cached

    def served(self, owner: str, key: bytes, nbytes: int, tier: str) -> None:
        self.touched(owner, key)

    def usage(self, owner: str) -> dict[str, int]:
        with self._lock:
            u = self._usage.get(owner) or _Usage()
            return {"entries": len(u.entries), "used": u.used, "reserved": u.reserved, "quota": self.quota(owner),
                    "hit_tokens": u.hit_tokens, "missed_tokens": u.missed_tokens}

    def owners(self) -> dict[str, dict[str, int]]:
        with self._lock:
            names = list(self._usage)
        return {name: self.usage(name) for name in names}



def _token_tenants(path: str) -> frozenset[str]:
    """The tenants the token file names (read once, at start; empty without one or when it cannot be read)."""
    if not path:
        return frozenset()
    from promptcache.sidecar.auth import TokenStore

    try:
        return frozenset(TokenStore(path)._tokens.values())
    except (OSError, ValueError):
        return frozenset()


class TenantCollector:
    """Prometheus gauges of each owner's stored bytes, entries and quota, read at scrape time."""

    def __init__(self, tenancy: Tenancy):
        self.tenancy = tenancy

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        used = GaugeMetricFamily("promptcache_tenant_stored_bytes", "bytes held in the memory tier, by owner "
                                 "(tenant, or group:NAME for a sharing group)", labels=["owner"])
        entries = GaugeMetricFamily("promptcache_tenant_entries", "chunks held in the memory tier, by owner",
                                    labels=["owner"])
        quota = GaugeMetricFamily("promptcache_tenant_quota_bytes", "byte quota, by owner (0: none)",
                                  labels=["owner"])
        if self.tenancy.enabled:
            for owner, u in self.tenancy.owners().items():
                used.add_metric([owner], u["used"])
                entries.add_metric([owner], u["entries"])
                quota.add_metric([owner], u["quota"])
        return [used, entries, quota]
