{{/*
The operator's RBAC rules (rbac.yaml), in two sets: least privilege, exactly the verbs the operator uses (kopf
watching/patching PromptCaches and its peering object, server-side apply of the children, pod listing for the
per-node status). Cluster-wide (no watchNamespaces) both sets go into the ClusterRole; with watchNamespaces the
namespaced set goes into a Role in each watched namespace and only the cluster-scoped set stays cluster-wide.
*/}}

{{/* Cluster-scoped objects only: what no Role can grant. */}}
{{- define "promptcache-operator.rbac.clusterRules" -}}
# kopf: discovering resources (and noticing CRDs installed later); the operator: which optional CRDs exist.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- if .Values.watchNamespaces }}
# kopf, namespace-restricted: which of the watched namespaces exist (it notices them being deleted and created).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
{{- else }}
# kopf: peering between replicas (the ClusterKopfPeering of a cluster-wide operator).
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
# Does the PriorityClass of the cache pods exist.
- apiGroups: [scheduling.k8s.io]
  resources: [priorityclasses]
  verbs: [get]
{{- end }}

{{/* Namespaced objects: cluster-wide in the ClusterRole, else in the Role of each watched namespace. */}}
{{- define "promptcache-operator.rbac.namespacedRules" -}}
# The custom resource: kopf lists/watches it and patches its own annotations; the operator writes status.
- apiGroups: [promptcache.io]
  resources: [promptcaches]
  verbs: [get, list, watch, patch]
- apiGroups: [promptcache.io]
  resources: [promptcaches/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need update on the owner's finalizers subresource.
- apiGroups: [promptcache.io]
  resources: [promptcaches/finalizers]
  verbs: [update]
# kopf: peering between replicas (KopfPeerings: a namespace-restricted operator's), posting events.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# The DaemonSet's FailedCreate events: a ResourceQuota refusing sidecar pods shows as Ready=False QuotaExceeded.
- apiGroups: [""]
  resources: [events]
  verbs: [list]
# Children, written by server-side apply (create + patch) and watched (list + watch) so that a child deleted
# or edited by hand is repaired at once rather than at the next resync.
- apiGroups: [""]
  resources: [configmaps, services, resourcequotas]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [daemonsets]
  verbs: [get, list, watch, create, patch]
# The cluster tier's Mooncake master (spec.cluster), and its Service; deleted when the tier is turned off.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [delete]
# The cluster tier's NetworkPolicies (spec.cluster): who reaches the Mooncake master and the sidecars' transfer
# ports; deleted with the tier.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
# Optional children (only when their CRDs exist); deleted when no longer wanted (e.g. alerts disabled).
- apiGroups: [autoscaling.k8s.io]
  resources: [verticalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, create, patch, delete]
# The cache pods: per-node endpoints for the status, the sidecars to scrape and Resize (pod IP and the ports the
# sidecar container declares), their memory limits.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
{{- end }}
