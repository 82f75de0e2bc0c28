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

{{/* Picker mode (mode: picker; docs/deploy/kubernetes.md "Picker mode"): pd-extproc alone, the endpoint picker of the
InferencePool the chart creates, called by a gateway's Envoy. */}}
{{- define "pd-extproc.picker" -}}
{{- if eq .Values.mode "picker" }}true{{ end }}
{{- end }}

{{/* The Secret holding the picker's TLS certificate (tls.crt, tls.key). */}}
{{- define "pd-extproc.tlsSecret" -}}
{{- .Values.picker.tls.secretName | default (printf "%s-tls" (include "pd-extproc.fullname" .)) }}
{{- end }}

{{/* Where the picker's container mounts that Secret. */}}
{{- define "pd-extproc.tlsDir" -}}
/etc/pd-extproc-tls
{{- end }}

{{/* The values pd-extproc's configuration is rendered from, as JSON: .Values, and in picker mode the
keys the mode decides, whatever the values say: endpoints from the chart's InferencePool, no prefill-leg
listener, EDS and Envoy admin (there is no Envoy in the pod), TLS with the mounted certificate (the
gateways dial the picker over TLS), the health port on 9003 unless health_listen names one (kubelet's
gRPC probes cannot speak TLS), and no fallback list where the gateway's cluster reads the header as one
host (provider none: ORIGINAL_DST, kgateway's subset load balancer). */}}
{{- define "pd-extproc.settings" -}}
{{- $v := deepCopy .Values -}}
{{- if and .Values.tokenizer.volume (not .Values.affinity.prefix.tokenizer) -}}
{{- $_ := set $v.affinity.prefix "tokenizer" .Values.tokenizer.mountPath -}}
{{- end -}}
{{- if and .Values.natsServer.enabled (not .Values.shared_state.nats.url) (not .Values.natsSecret.urlKey) -}}
{{- $_ := set $v.shared_state.nats "url" (printf "nats://%s-nats:%d" (include "pd-extproc.fullname" .) (int .Values.natsServer.port)) -}}
{{- end -}}
{{- if include "pd-extproc.picker" . -}}
{{- $pool := dict "name" (include "pd-extproc.fullname" .) "namespace" .Release.Namespace -}}
{{- $_ := set $v.discovery "source" "inferencepool" -}}
{{- $_ := set $v.discovery "inferencepool" $pool -}}
{{- $_ := set $v.handoff "prefill_via" "" -}}
{{- $_ := set $v.xds "serve_eds" false -}}
{{- $_ := set $v.envoy_health "admin_url" "" -}}
{{- $dir := include "pd-extproc.tlsDir" . -}}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "client_ca_file" "" -}}
{{- $_ := set $v "tls" $tls -}}
{{- $_ := set $v "health_listen" ($v.health_listen | default "0.0.0.0:9003") -}}
{{- if ne .Values.provider.name "istio" -}}
{{- $_ := set $v.routing "fallback_count" 0 -}}
{{- end -}}
{{- end -}}
{{- toJson $v -}}
{{- end }}

{{/* The pd-extproc configuration file: every key of config/pd-extproc.yaml, from the value of the
same name (tests/deploy/test_helm_chart.py keeps the two key sets equal), as "pd-extproc.settings" says. */}}
{{- define "pd-extproc.config" -}}
{{- $v := include "pd-extproc.settings" . | fromJson -}}
{{- $k := $v.discovery.kubernetes -}}
listen: {{ $v.listen | toJson }}
metrics_listen: {{ $v.metrics_listen | toJson }}
health_listen: {{ $v.health_listen | toJson }}
admin:
  debug_endpoints: {{ $v.admin.debug_endpoints | toJson }}
discovery:
  eds_files: {{ $v.discovery.eds_files | toJson }}
  prefill_cluster: {{ $v.discovery.prefill_cluster | toJson }}
  decode_cluster: {{ $v.discovery.decode_cluster | toJson }}
  metadata_namespace: {{ $v.discovery.metadata_namespace | toJson }}
  poll_interval_seconds: {{ include "pd-extproc.decimal" $v.discovery.poll_interval_seconds }}
  source: {{ $v.discovery.source | toJson }}
  kubernetes:
    kubeconfig: {{ $k.kubeconfig | toJson }}
    namespaces: {{ include "pd-extproc.namespaces" . }}
    preset: {{ $k.preset | toJson }}
    role_label: {{ $k.role_label | toJson }}
    prefill_role: {{ $k.prefill_role | toJson }}
    decode_role: {{ $k.decode_role | toJson }}
    both_role: {{ $k.both_role | toJson }}
    prefill_port: {{ $k.prefill_port | toJson }}
    decode_port: {{ $k.decode_port | toJson }}
    group_label: {{ $k.group_label | toJson }}
    capacity_annotation: {{ $k.capacity_annotation | toJson }}
    bootstrap_port_annotation: {{ $k.bootstrap_port_annotation | toJson }}
    metrics_port_annotation: {{ $k.metrics_port_annotation | toJson }}
    kv_events_port_annotation: {{ $k.kv_events_port_annotation | toJson }}
    kv_events_replay_port_annotation: {{ $k.kv_events_replay_port_annotation | toJson }}
    data_parallel_size_annotation: {{ $k.data_parallel_size_annotation | toJson }}
    models_annotation: {{ $k.models_annotation | toJson }}
  inferencepool:
    name: {{ $v.discovery.inferencepool.name | toJson }}
    namespace: {{ $v.discovery.inferencepool.namespace | toJson }}
affinity:
  mode: {{ ternary "off" $v.affinity.mode (eq (toString $v.affinity.mode) "false") | toJson }}
  bonus: {{ include "pd-extproc.decimal" $v.affinity.bonus }}
  auto:
    {{- $a := $v.affinity.auto }}
    kv_bytes_per_token: {{ int64 $a.kv_bytes_per_token }}
    num_layers: {{ int64 $a.num_layers }}
    num_kv_heads: {{ int64 $a.num_kv_heads }}
    head_dim: {{ int64 $a.head_dim }}
    dtype_bytes: {{ int64 $a.dtype_bytes }}
    same_group_gbps: {{ include "pd-extproc.decimal" $a.same_group_gbps }}
    cross_group_gbps: {{ include "pd-extproc.decimal" $a.cross_group_gbps }}
    base_latency_ms: {{ include "pd-extproc.decimal" $a.base_latency_ms }}
    wait_scale_ms: {{ include "pd-extproc.decimal" $a.wait_scale_ms }}
    prefill_ms_per_token: {{ include "pd-extproc.decimal" $a.prefill_ms_per_token }}
    cpu_tier_gbps: {{ include "pd-extproc.decimal" $a.cpu_tier_gbps }}
    lora_load_ms: {{ include "pd-extproc.decimal" $a.lora_load_ms }}
  prefix:
    {{- $p := $v.affinity.prefix }}
    enabled: {{ $p.enabled | toJson }}
    block_tokens: {{ int64 $p.block_tokens }}
    max_blocks: {{ int64 $p.max_blocks }}
    weight: {{ include "pd-extproc.decimal" $p.weight }}
    self_correct: {{ $p.self_correct | toJson }}
    source: {{ $p.source | toJson }}
    tokenizer: {{ $p.tokenizer | toJson }}
    cpu_tier_weight: {{ include "pd-extproc.decimal" $p.cpu_tier_weight }}
    kv_events:
      {{- $e := $p.kv_events }}
      port: {{ int64 $e.port }}
      replay_port: {{ int64 $e.replay_port }}
      stale_after_seconds: {{ include "pd-extproc.decimal" $e.stale_after_seconds }}
      recent_seconds: {{ include "pd-extproc.decimal" $e.recent_seconds }}
      max_blocks_per_endpoint: {{ int64 $e.max_blocks_per_endpoint }}
      queue_batches: {{ int64 $e.queue_batches }}
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
  eject_failed_prefill_seconds: {{ include "pd-extproc.decimal" $v.handoff.eject_failed_prefill_seconds }}
  watch_streamed_answers: {{ $v.handoff.watch_streamed_answers | toJson }}
xds:
  serve_eds: {{ $v.xds.serve_eds | toJson }}
  no_envoy_delay_seconds: {{ include "pd-extproc.decimal" $v.xds.no_envoy_delay_seconds }}
tls:
  cert_file: {{ $v.tls.cert_file | toJson }}
  key_file: {{ $v.tls.key_file | toJson }}
  client_ca_file: {{ $v.tls.client_ca_file | toJson }}
limits:
  max_inflight_requests: {{ int64 $v.limits.max_inflight_requests }}
  retry_after_seconds: {{ int64 $v.limits.retry_after_seconds }}
flow_control:
  {{- $f := $v.flow_control }}
  enabled: {{ $f.enabled | toJson }}
  objectives:
  {{- range $name, $priority := $f.objectives }}
    {{ $name | toJson }}: {{ int64 $priority }}
  {{- end }}
  default_objective: {{ $f.default_objective | toJson }}
  max_queued_requests: {{ int64 $f.max_queued_requests }}
  max_queue_seconds: {{ include "pd-extproc.decimal" $f.max_queue_seconds }}
  max_flows: {{ int64 $f.max_flows }}
  reserved_requests: {{ int64 $f.reserved_requests }}
  engine_priority: {{ $f.engine_priority | toJson }}
  queue_depth_threshold: {{ int64 $f.queue_depth_threshold }}
  kv_cache_threshold: {{ include "pd-extproc.decimal" $f.kv_cache_threshold }}
engine_metrics:
  enabled: {{ $v.engine_metrics.enabled | toJson }}
  interval_seconds: {{ include "pd-extproc.decimal" $v.engine_metrics.interval_seconds }}
  timeout_seconds: {{ include "pd-extproc.decimal" $v.engine_metrics.timeout_seconds }}
  stale_after_intervals: {{ int64 $v.engine_metrics.stale_after_intervals }}
  engine: {{ $v.engine_metrics.engine | toJson }}
  path: {{ $v.engine_metrics.path | toJson }}
  port: {{ int64 $v.engine_metrics.port }}
  max_bytes: {{ int64 $v.engine_metrics.max_bytes }}
  queue_weight: {{ include "pd-extproc.decimal" $v.engine_metrics.queue_weight }}
  queued_request_tokens: {{ int64 $v.engine_metrics.queued_request_tokens }}
  models_interval_seconds: {{ include "pd-extproc.decimal" $v.engine_metrics.models_interval_seconds }}
envoy_health:
  admin_url: {{ $v.envoy_health.admin_url | toJson }}
  interval_seconds: {{ include "pd-extproc.decimal" $v.envoy_health.interval_seconds }}
  timeout_seconds: {{ include "pd-extproc.decimal" $v.envoy_health.timeout_seconds }}
shared_state:
  {{- $s := $v.shared_state }}
  kind: {{ $s.kind | toJson }}
  heartbeat_seconds: {{ include "pd-extproc.decimal" $s.heartbeat_seconds }}
  peer_timeout_seconds: {{ include "pd-extproc.decimal" $s.peer_timeout_seconds }}
  batch_seconds: {{ include "pd-extproc.decimal" $s.batch_seconds }}
  sync_wait_seconds: {{ include "pd-extproc.decimal" $s.sync_wait_seconds }}
  decision_slot_ms: {{ include "pd-extproc.decimal" $s.decision_slot_ms }}
  sync_answer_seconds: {{ include "pd-extproc.decimal" $s.sync_answer_seconds }}
  sync_max_waiting: {{ int64 $s.sync_max_waiting }}
  nats:
    url: {{ $s.nats.url | toJson }}
    creds_file: {{ $s.nats.creds_file | toJson }}
    token: {{ $s.nats.token | toJson }}
    subject_prefix: {{ $s.nats.subject_prefix | toJson }}
    hash_key: {{ $s.nats.hash_key | toJson }}
    tls:
      ca: {{ $s.nats.tls.ca | toJson }}
      cert: {{ $s.nats.tls.cert | toJson }}
      key: {{ $s.nats.tls.key | toJson }}
tracing:
  otlp_endpoint: {{ $v.tracing.otlp_endpoint | toJson }}
  sampling_ratio: {{ include "pd-extproc.decimal" $v.tracing.sampling_ratio }}
  service_name: {{ $v.tracing.service_name | toJson }}
{{- end }}
