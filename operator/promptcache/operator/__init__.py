"""PromptCache Kubernetes operator: CRD promptcache.io/v1alpha1 PromptCache -> node-local cache sidecars.

model     typed spec (same defaults and rules as the CRD)
builders  pure spec -> manifests
kube      thin API-server client (server-side apply, status)
reconcile one level-based reconcile
handlers  kopf handlers (create/update/resume + resync timer)
__main__  `python -m promptcache.operator` / `promptcache operator`: main(argv)
"""
