"""`python -m promptcache.operator` (and `promptcache operator ...`): run the kopf operator.

Peering: every replica joins the ClusterKopfPeering (or KopfPeering with --namespace) named by --peering; kopf
lets only the replica with the highest priority work and pauses the others. Each replica picks a random
priority unless --priority is given, so replicas of one Deployment never tie (a tie freezes all of them).
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import threading


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="promptcache operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--namespace", action="append", default=None,
                   help="watch only this namespace (repeatable; env PROMPTCACHE_OPERATOR_NAMESPACES, comma-"
                        "separated); default: all namespaces")
    p.add_argument("--peering", default=env("PROMPTCACHE_OPERATOR_PEERING", "promptcache-operator"),
                   help="kopf peering object name (env PROMPTCACHE_OPERATOR_PEERING; default %(default)s)")
    p.add_argument("--standalone", action="store_true",
                   default=env("PROMPTCACHE_OPERATOR_STANDALONE", "") in ("1", "true"),
                   help="no peering: for a single replica without the peering CRD")
    p.add_argument("--priority", type=int, default=int(env("PROMPTCACHE_OPERATOR_PRIORITY", "0")) or None,
                   help="peering priority (env PROMPTCACHE_OPERATOR_PRIORITY; default: random, distinct per "
                        "replica)")
    p.add_argument("--liveness", default=env("PROMPTCACHE_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
                   help="kopf liveness endpoint URL, '' for none (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=int(env("PROMPTCACHE_OPERATOR_METRICS_PORT", "8081")),
                   help="port of the operator's Prometheus /metrics (cache conditions, reconciles); 0: off "
                        "(env PROMPTCACHE_OPERATOR_METRICS_PORT; default %(default)s)")
    p.add_argument("--resync-seconds", type=float,
                   default=float(env("PROMPTCACHE_OPERATOR_RESYNC_SECONDS", "30")),
                   help="interval of the level-based resync timer (default %(default)s)")
    p.add_argument("--log-format", choices=["plain", "full", "json"],
                   default=env("PROMPTCACHE_OPERATOR_LOG_FORMAT", "full"))
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    return p


def main(argv: list[str] | None = None, stop_flag: threading.Event | None = None,
         ready_flag: threading.Event | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    os.environ["PROMPTCACHE_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)

    import kopf

    kopf.configure(debug=args.debug, verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()])
    from . import handlers  # registers the handlers

    namespaces = args.namespace or [n for n in os.environ.get("PROMPTCACHE_OPERATOR_NAMESPACES", "").split(",")
                                    if n]
    if not args.standalone:
        problem = handlers.kube().peering_problem(args.peering, namespaces)
        if problem:  # kopf would wait for the peering silently, doing nothing: refuse to start instead
            logging.getLogger("promptcache.operator").error("cannot start: %s", problem)
            print(f"promptcache operator: {problem}", file=sys.stderr, flush=True)
            return 2
    if args.metrics_port:
        from . import telemetry

        try:
            port = telemetry.serve(args.metrics_port)
        except OSError as exc:
            print(f"promptcache operator: --metrics-port {args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        logging.getLogger("promptcache.operator").info("metrics on :%d/metrics", port)
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    logging.getLogger("promptcache.operator").info("peering %s, priority %d", args.peering, priority)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        liveness_endpoint=args.liveness or None,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
