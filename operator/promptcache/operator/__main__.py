"""`python -m promptcache.operator` (and `promptcache operator ...`): run the kopf operator.

Peering: every replica joins the ClusterKopfPeering (or KopfPeering with --namespace) named by --peering; kopf
lets only the replica with the highest priority work and pauses the others. Each replica picks a random
priority unless --priority is given, so replicas of one Deployment never tie (a tie freezes all of them). The
peering identity is given to kopf explicitly (config.peering_identity: the pod's name in a pod), so a uid without a
passwd entry does not crash it.
"""
from __future__ import annotations

import logging
import os
import random
import sys
import threading

from .config import OperatorConfig, literal_namespaces

log = logging.getLogger("promptcache.operator")


def main(argv: list[str] | None = None, stop_flag: threading.Event | None = None,
         ready_flag: threading.Event | None = None) -> int:
    try:
        config = OperatorConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ, __doc__)
    except ValueError as exc:
        print(f"promptcache operator: {exc}", file=sys.stderr)
        return 2

    import kopf

    from .handlers import Operator
    from .kube import Kube

    kopf.configure(debug=config.debug, verbose=config.verbose, log_format=kopf.LogFormat[config.log_format.upper()])
    try:
        kube = Kube(crd_cache_seconds=config.crd_cache_seconds)
    except Exception as exc:  # noqa: BLE001 - no service account and no kubeconfig, or one the loader cannot read
        print(f"promptcache operator: no Kubernetes API to talk to: {type(exc).__name__}: {exc} (in a pod its "
              "service account is used; elsewhere $KUBECONFIG or ~/.kube/config)", file=sys.stderr)
        return 2
    operator = Operator(config, kube)
    if not config.standalone:
        # only namespaces given by name can be checked; kopf finds those its patterns match as they come
        problem = operator.kube.peering_problem(config.peering, literal_namespaces(config.namespaces),
                                                namespaced=bool(config.namespaces))
        if problem:  # kopf would wait for the peering silently, doing nothing: refuse to start instead
            log.error("cannot start: %s", problem)
            print(f"promptcache operator: {problem}", file=sys.stderr, flush=True)
            return 2
    if config.metrics_port:
        from . import telemetry

        try:
            port = telemetry.serve(config.metrics_port)
        except OSError as exc:
            print(f"promptcache operator: --metrics-port {config.metrics_port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        log.info("metrics on :%d/metrics", port)
    priority = config.priority if config.priority is not None else random.randint(1, 2**31 - 1)
    log.info("peering %s, priority %d, identity %s", config.peering, priority, config.identity)
    kopf.run(
        identity=config.identity or None,  # kopf.Identity is a NewType of str
        registry=operator.registry(),
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        standalone=config.standalone,
        peering_name=None if config.standalone else config.peering,
        priority=priority,
        liveness_endpoint=config.liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
