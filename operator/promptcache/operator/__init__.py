"""PromptCache Kubernetes operator: CRD promptcache.io/v1alpha1 PromptCache -> node-local cache sidecars.

model     typed spec (same defaults and rules as the CRD)
builders  pure spec -> manifests
kube      thin API-server client (server-side apply, status)
reconcile one level-based reconcile
fleet     a cache's sidecars (its pods), one scrape of each per tick, the hit ratios status and autoscaler read
autoscale the memory autoscaler's actuation (tuning: its policy)
config    the operator's configuration, built once in main
handlers  kopf handlers (create/update/resume + resync timer, autoscaling timer, drift), bound to the configuration
__main__  `python -m promptcache.operator` / `promptcache operator`: main(argv)
"""
