"""The operator's configuration: one object, built once in `main` from the command line and the environment (the
chart sets the environment), then handed to the handlers. Nothing else in the operator reads the environment."""
from __future__ import annotations

import argparse
import datetime
import math
import os
import pwd
import random
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from .autoscale import Config as AutoscaleConfig
from .builders import OperatorDefaults

LOG_FORMATS = ("plain", "full", "json")


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()            # empty: all namespaces; kopf patterns ('team-*', '!kube-*')
    namespaces_source: str = field(default="--namespace", compare=False)  # what the message of a bad one names
    peering: str = "promptcache-operator"
    standalone: bool = False
    priority: int | None = None                 # None: random, distinct per replica
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    metrics_port: int = 8081                    # 0: off
    resync_seconds: float = 30.0
    log_format: str = "full"
    verbose: bool = False
    debug: bool = False
    crd_cache_seconds: float = 10.0
    workers: int = 16
    prometheus_url: str | None = None           # the autoscaler's signal from this Prometheus instead of scraping
    defaults: OperatorDefaults = field(default_factory=OperatorDefaults)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    identity: str = field(default="", compare=False)  # kopf peering identity (peering_identity)

    @property
    def observation_max_age_s(self) -> float:
        """How long one scrape of a cache's sidecars serves status and autoscaler (fleet.Fleet.max_age_s): half the
        shorter timer period, so a resync and an autoscaling tick that run close together read the same scrape."""
        return min(self.resync_seconds, self.autoscale.interval_s) / 2

    @classmethod
    def from_args(cls, argv: list[str], env: Mapping[str, str], description: str = "") -> "OperatorConfig":
        """Raises SystemExit (argparse) for a bad option, ValueError for a bad environment variable."""
        args = build_parser(env, description).parse_args(argv)
        if args.namespace:
            namespaces, source = [n.strip() for n in args.namespace], "--namespace"
        else:
            namespaces = [n.strip() for n in env.get("PROMPTCACHE_OPERATOR_NAMESPACES", "").split(",") if n.strip()]
            source = "PROMPTCACHE_OPERATOR_NAMESPACES"
        return cls(namespaces=tuple(namespaces), namespaces_source=source, peering=args.peering,
                   standalone=args.standalone,
                   priority=args.priority, liveness=args.liveness or None, metrics_port=args.metrics_port,
                   resync_seconds=args.resync_seconds, log_format=args.log_format, verbose=args.verbose,
                   debug=args.debug,
                   crd_cache_seconds=_number(env, "PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS", cls.crd_cache_seconds),
                   workers=_whole(env, "PROMPTCACHE_OPERATOR_WORKERS", cls.workers),
                   prometheus_url=env.get("PROMPTCACHE_OPERATOR_PROMETHEUS_URL") or None,
                   defaults=OperatorDefaults.from_env(env), autoscale=AutoscaleConfig.from_env(env),
                   identity=peering_identity(env, os.getuid(), socket.gethostname())).validate()

    def validate(self) -> "OperatorConfig":
        """Raises ValueError naming the option (and its variable) that no run could use."""
        for ns in self.namespaces:
            problem = namespace_pattern_error(ns)
            if problem:
                raise ValueError(f"{self.namespaces_source} {ns!r} {problem}")
        if not self.standalone and not (len(self.peering) <= 253 and _DNS_SUBDOMAIN.fullmatch(self.peering)):
            raise ValueError(f"--peering {self.peering!r} is not an object name (a DNS-1123 subdomain)")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535 (0: off), got {self.metrics_port}")
        if not (math.isfinite(self.resync_seconds) and self.resync_seconds > 0):
            raise ValueError(f"--resync-seconds must be a number of seconds above 0, got {self.resync_seconds}")
        if not (math.isfinite(self.crd_cache_seconds) and self.crd_cache_seconds >= 0):
            raise ValueError("PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS must be a number of seconds, 0 or more, got "
                             f"{self.crd_cache_seconds}")
        if self.workers < 1:
            raise ValueError(f"PROMPTCACHE_OPERATOR_WORKERS must be at least 1, got {self.workers}")
        return self


def login_name(env: Mapping[str, str], uid: int) -> str | None:
    """The user name as getpass.getuser() finds it (LOGNAME, USER, LNAME, USERNAME, then the passwd entry), or
    None where there is none: a container running as a uid without a passwd entry (the chart's 65532)."""
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if env.get(name):
            return env[name]
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def peering_identity(env: Mapping[str, str], uid: int, host: str, now: datetime.datetime | None = None,
                     rnd: str | None = None) -> str:
    """The identity this replica registers under in the kopf peering object, given explicitly to kopf.run so that
    kopf never calls getpass.getuser() (which raises KeyError for a uid without a passwd entry and crash-loops
    the pod). In a pod: its name (the chart sets POD_NAME from the downward API; kopf's own POD_ID works too).
    Elsewhere kopf's form, user@host/time/random, with uid<N> where the uid has no name."""
    pod = env.get("POD_NAME") or env.get("POD_ID")
    if pod:
        return pod
    user = login_name(env, uid) or f"uid{uid}"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    rnd = rnd if rnd is not None else "".join(random.choices("abcdefhijklmnopqrstuvwxyz0123456789", k=3))
    return f"{user}@{host}/{now.strftime('%Y%m%d%H%M%S')}/{rnd}"


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAMESPACE_GLOB = re.compile(r"[a-z0-9*?]([-a-z0-9*?]{0,61}[a-z0-9*?])?")


def is_namespace_pattern(ns: str) -> bool:
    """Whether kopf reads `ns` as a pattern (globs, negations, a list), not one namespace."""
    return any(c in ns for c in "*?!,")


def literal_namespaces(namespaces: tuple[str, ...] | list[str]) -> list[str]:
    """The namespaces given by name (kopf's select_specific_namespaces): those a per-namespace object (the
    chart's RBAC, a KopfPeering) can be looked up in."""
    return [ns for ns in namespaces if not is_namespace_pattern(ns)]


def namespace_pattern_error(ns: str) -> str:
    """Why kopf could match no namespace with `ns` ("" when it can): a namespace name (DNS-1123 label), or kopf's
    pattern syntax (kopf match_namespace): comma-separated globs, each a namespace name in which '*' and '?' stand
    for any characters or one, a leading '!' excluding what it matches."""
    parts = [p.strip() for p in ns.split(",")]
    for part in parts:
        glob = part[1:] if part.startswith("!") else part
        if not (_NAMESPACE_GLOB.fullmatch(glob) if is_namespace_pattern(ns) else _DNS_LABEL.fullmatch(glob)):
            return ("is not a namespace name (a DNS-1123 label: lower-case letters, digits and '-', at most 63) "
                    "or a kopf namespace pattern (globs with '*' and '?', '!' in front to exclude, "
                    "comma-separated)")
    return ""
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _number(env: Mapping[str, str], name: str, default, kind=float):
    """A number from the environment (float, or int for kind=int), refused naming the variable."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {'whole number' if kind is int else 'number'}") from None


def _whole(env: Mapping[str, str], name: str, default: int) -> int:
    return _number(env, name, default, int)


def build_parser(env: Mapping[str, str], description: str = "") -> argparse.ArgumentParser:
    get = env.get
    d = OperatorConfig
    p = argparse.ArgumentParser(prog="promptcache operator", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--namespace", action="append", default=None,
                   help="watch only this namespace, or those a kopf pattern matches ('team-*', '!kube-*') "
                        "(repeatable; env PROMPTCACHE_OPERATOR_NAMESPACES, comma-separated); default: all namespaces")
    p.add_argument("--peering", default=get("PROMPTCACHE_OPERATOR_PEERING", d.peering),
                   help="kopf peering object name (env PROMPTCACHE_OPERATOR_PEERING; default %(default)s)")
    p.add_argument("--standalone", action="store_true",
                   default=get("PROMPTCACHE_OPERATOR_STANDALONE", "") in ("1", "true"),
                   help="no peering: for a single replica without the peering CRD")
    p.add_argument("--priority", type=int, default=_whole(env, "PROMPTCACHE_OPERATOR_PRIORITY", 0) or None,
                   help="peering priority (env PROMPTCACHE_OPERATOR_PRIORITY; default: random, distinct per "
                        "replica)")
    p.add_argument("--liveness", default=get("PROMPTCACHE_OPERATOR_LIVENESS", d.liveness),
                   help="kopf liveness endpoint URL, '' for none (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=_whole(env, "PROMPTCACHE_OPERATOR_METRICS_PORT", d.metrics_port),
                   help="port of the operator's Prometheus /metrics (cache conditions, reconciles); 0: off "
                        "(env PROMPTCACHE_OPERATOR_METRICS_PORT; default %(default)s)")
    p.add_argument("--resync-seconds", type=float,
                   default=_number(env, "PROMPTCACHE_OPERATOR_RESYNC_SECONDS", d.resync_seconds),
                   help="interval of the level-based resync timer (default %(default)s)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=get("PROMPTCACHE_OPERATOR_LOG_FORMAT", d.log_format))
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    return p
