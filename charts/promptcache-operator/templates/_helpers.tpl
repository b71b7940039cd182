{{/* Chart name, truncated to 63 characters. */}}
{{- define "promptcache-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release name, plus the chart name unless the release name contains it. */}}
{{- define "promptcache-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The metrics Service: "<fullname>-metrics" within a Service name's 63 characters (fullname cut to 55). */}}
{{- define "promptcache-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "promptcache-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* podLabels, refused where they would override the selector labels (the Deployment would be refused). */}}
{{- define "promptcache-operator.podLabels" -}}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/instance" }}
{{- if hasKey $.Values.podLabels $key }}
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
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
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
