{{/* Chart name (nameOverride), truncated to 63 characters. */}}
{{- define "promptcache-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: fullnameOverride, else the release name plus the chart name unless the release name contains it.
Dots (Helm allows them in release names) become dashes: the names are DNS labels (Service, pod host names). */}}
{{- define "promptcache-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- $release := .Release.Name | replace "." "-" }}
{{- if contains $name $release }}
{{- $release | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" $release $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the cluster-scoped RBAC objects (and, alike, of the Roles): the full name and the release namespace, so
that releases of the same name in different namespaces (a namespace-restricted operator per team) do not collide. */}}
{{- define "promptcache-operator.rbacName" -}}
{{- printf "%s-%s" (include "promptcache-operator.fullname" .) .Release.Namespace }}
{{- end }}

{{/* The metrics Service: "<fullname>-metrics" within a Service name's 63 characters (fullname cut to 55). A Service
name is a DNS-1035 label: it must start with a letter. */}}
{{- define "promptcache-operator.metricsServiceName" -}}
{{- $name := printf "%s-metrics" (include "promptcache-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- if not (regexMatch "^[a-z]" $name) }}
{{- fail (printf "the metrics Service would be named %s, and a Service name must start with a letter: set fullnameOverride (or use a release name that starts with a letter)" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* podLabels, refused where they would override the selector labels (the Deployment would be refused). */}}
{{- define "promptcache-operator.podLabels" -}}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/instance" }}
{{- if hasKey ($.Values.podLabels | default dict) $key }}
{{- fail (printf "podLabels may not set %s: the chart sets it, and the Deployment selects its pods by it" $key) }}
{{- end }}
{{- end }}
{{- with .Values.podLabels }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{- define "promptcache-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "promptcache-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: promptcache
{{- end }}

{{- define "promptcache-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "promptcache-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "promptcache-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "promptcache-operator.fullname" .) .Values.serviceAccount.name }}
{{- else if .Values.serviceAccount.name }}
{{- .Values.serviceAccount.name }}
{{- else }}
{{- fail "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false: the chart binds the operator's ClusterRole to it (the namespace's default ServiceAccount, and every pod that runs as it, would get the operator's permissions)" }}
{{- end }}
{{- end }}

{{- define "promptcache-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* monitoring.labels as k=v,k=v (PROMPTCACHE_OPERATOR_MONITORING_LABELS of the operator) */}}
{{- define "promptcache-operator.monitoringLabels" -}}
{{- $out := list -}}
{{- range $k, $v := .Values.monitoring.labels -}}
{{- $out = append $out (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
