{{/* The pod's Envoy bootstrap. Listeners, filters, routes, the pd_extproc cluster and the
prefill/decode load balancing are envoy/envoy.yaml's, verbatim (tests/test_helm_chart.py keeps
them equal; see envoy/envoy.yaml and the README's "Envoy wiring" for every choice). What differs:
prefill and decode take their endpoints from pd-extproc over ADS instead of EDS files, and a
stats listener serves /ready and /stats/prometheus (the admin stays on loopback). */}}
{{- define "pd-extproc.envoy" -}}
{{- $destination := .Values.routing.destination_header -}}
{{- $extprocPort := include "pd-extproc.port" .Values.listen -}}
{{- /* Envoy waits for the body answer of kv-transfer-params up to 2 x handoff.prefill_timeout_seconds
+ 5 s (a prefill leg and its retry), at least the shipped 600 s; Envoy allows at most 1 h. */ -}}
{{- $legs := addf (mulf 2 (float64 .Values.handoff.prefill_timeout_seconds)) 5 -}}
{{- if and (eq .Values.handoff.mode "kv-transfer-params") (gt $legs 3600.0) }}
{{- fail (printf "handoff.prefill_timeout_seconds: %v is too long for handoff.mode kv-transfer-params: Envoy waits 2 x it + 5 s for the answer, and its max_message_timeout is at most 1 h; use at most 1797.5" .Values.handoff.prefill_timeout_seconds) }}
{{- end -}}
node:
  id: pd-gateway
  cluster: pd-gateway

admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: 9901}

dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services:
    - envoy_grpc: {cluster_name: pd_extproc}

static_resources:
  listeners:
  - name: gateway
    address:
      socket_address: {address: 0.0.0.0, port_value: 8080}
    per_connection_buffer_limit_bytes: 16777216
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          request_timeout: 0s
          stream_idle_timeout: 300s
          route_config:
            name: inference
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match: {prefix: "/v1/"}
                route:
                  cluster: decode
                  timeout: 0s
                  idle_timeout: 300s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset-before-request
                    num_retries: 2
                    per_try_timeout: 0s
              - match: {prefix: "/"}
                direct_response:
                  status: 404
                  body:
                    inline_string: '{"error":{"message":"unknown path: the gateway serves the OpenAI API under /v1/","type":"not_found_error","param":null,"code":"unknown_path"}}'
                response_headers_to_add:
                - header: {key: content-type, value: application/json}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    disabled: true
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: pd_extproc}
              failure_mode_allow: false
              message_timeout: 5s
              max_message_timeout: {{ include "pd-extproc.decimal" (minf 3600 (maxf 600 $legs)) }}s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: BUFFERED
                response_header_mode: SKIP
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
              metadata_options:
                receiving_namespaces:
                  untyped: [envoy.lb]
                forwarding_namespaces:
                  untyped: [envoy.lb.subset_hint]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

  # Loopback only: pd-extproc sends the prefill leg of the engine handoffs here.
  - name: prefill_leg
    address:
      socket_address: {address: 127.0.0.1, port_value: 10001}
    per_connection_buffer_limit_bytes: 16777216
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: prefill_leg
          request_timeout: 0s
          stream_idle_timeout: 300s
          preserve_external_request_id: true
          route_config:
            name: prefill_leg
            virtual_hosts:
            - name: prefill_leg
              domains: ["*"]
              routes:
              - match: {prefix: "/v1/"}
                route:
                  cluster: prefill
                  timeout: 0s
                  idle_timeout: 300s
                response_headers_to_add:
                - header: {key: x-gateway-prefill-upstream, value: "%UPSTREAM_REMOTE_ADDRESS%"}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

  # Kubelet's probes and Prometheus: exactly /ready and /stats/prometheus of the loopback admin.
  - name: stats
    address:
      socket_address: {address: 0.0.0.0, port_value: {{ .Values.envoy.statsPort }}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: stats
          route_config:
            name: stats
            virtual_hosts:
            - name: stats
              domains: ["*"]
              routes:
              - match: {path: /ready}
                route: {cluster: envoy_admin}
              - match: {path: /stats/prometheus}
                route: {cluster: envoy_admin}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router

  clusters:
  - name: pd_extproc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options:
            max_concurrent_streams: 10000
    circuit_breakers:
      thresholds:
      - {max_connections: 10000, max_pending_requests: 10000, max_requests: 100000, max_retries: 10}
    load_assignment:
      cluster_name: pd_extproc
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: 127.0.0.1, port_value: {{ $extprocPort }}}

  - name: decode
    type: EDS
    connect_timeout: 2s
    eds_cluster_config:
      eds_config:
        ads: {}
        resource_api_version: V3
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1000}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata:
                key: envoy.lb
                path: [{key: {{ $destination }}}]
            - header: {{ $destination }}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest

  - name: prefill
    type: EDS
    connect_timeout: 2s
    eds_cluster_config:
      eds_config:
        ads: {}
        resource_api_version: V3
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1000}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: {{ $destination }}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest

  - name: envoy_admin
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: envoy_admin
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {address: 127.0.0.1, port_value: 9901}
{{- end }}
