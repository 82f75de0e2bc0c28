{{/* Names and labels. */}}
{{- define "pd-extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-extproc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pd-extproc.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pd-extproc.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pd-extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pd-extproc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pd-extproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pd-extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pd-extproc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The port of a host:port value. */}}
{{- define "pd-extproc.port" -}}
{{- regexFind "[0-9]+$" . }}
{{- end }}

{{/* A number from a values file (float64), --set (int64, or a string such as "0.1") or the
schema-checked string forms, as a plain YAML decimal: never an exponent, which YAML 1.1 reads as a
string (1e-05), and at most 9 decimals (the grid affinity compares on). */}}
{{- define "pd-extproc.decimal" -}}
{{- regexReplaceAll "\\.?0+$" (printf "%.9f" (float64 .)) "" }}
{{- end }}

{{/* discovery.kubernetes.namespaces, the release namespace when empty, as a JSON list. */}}
{{- define "pd-extproc.namespaces" -}}
{{- .Values.discovery.kubernetes.namespaces | default (list .Release.Namespace) | toJson }}
{{- end }}

{{/* The pd-extproc configuration file. Every key of config/pd-extproc.yaml, from the values of the
same name. discovery.source and discovery.kubernetes are written only for source kubernetes, the
optional discovery.kubernetes keys only when set. The last key switches on pd-extproc's xDS server
(EDS over ADS for the pod's Envoy): its name here, xds.enabled, must match the xDS branch's. */}}
{{- define "pd-extproc.config" -}}
{{- $v := .Values -}}
listen: {{ $v.listen | toJson }}
metrics_listen: {{ $v.metrics_listen | toJson }}
discovery:
{{- if eq $v.discovery.source "kubernetes" }}
  source: kubernetes
  kubernetes:
    namespaces: {{ include "pd-extproc.namespaces" . }}
    {{- range $key, $value := omit $v.discovery.kubernetes "namespaces" }}
    {{ $key }}: {{ $value | toJson }}
    {{- end }}
{{- end }}
  eds_files: {{ $v.discovery.eds_files | toJson }}
  prefill_cluster: {{ $v.discovery.prefill_cluster | toJson }}
  decode_cluster: {{ $v.discovery.decode_cluster | toJson }}
  metadata_namespace: {{ $v.discovery.metadata_namespace | toJson }}
  poll_interval_seconds: {{ include "pd-extproc.decimal" $v.discovery.poll_interval_seconds }}
affinity:
  mode: {{ ternary "off" $v.affinity.mode (eq (toString $v.affinity.mode) "false") | toJson }}
  bonus: {{ include "pd-extproc.decimal" $v.affinity.bonus }}
load:
  default_max_tokens: {{ int64 $v.load.default_max_tokens }}
  default_token_capacity: {{ include "pd-extproc.decimal" $v.load.default_token_capacity }}
routing:
  fallback_count: {{ int64 $v.routing.fallback_count }}
  destination_header: {{ $v.routing.destination_header | toJson }}
  prefill_header: {{ $v.routing.prefill_header | toJson }}
  pd_threshold_tokens: {{ int64 $v.routing.pd_threshold_tokens }}
handoff:
  mode: {{ $v.handoff.mode | toJson }}
  prefill_via: {{ $v.handoff.prefill_via | toJson }}
  prefill_timeout_seconds: {{ include "pd-extproc.decimal" $v.handoff.prefill_timeout_seconds }}
  on_prefill_failure: {{ $v.handoff.on_prefill_failure | toJson }}
  default_bootstrap_port: {{ int64 $v.handoff.default_bootstrap_port }}
{{- if $v.xds.enabled }}
xds:
  enabled: true
{{- end }}
{{- end }}
