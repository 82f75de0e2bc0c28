{{/* The pod's Envoy bootstrap: envoy/envoy-ads.yaml (envoy/envoy.yaml with the prefill/decode
endpoints from pd-extproc over ADS) without its comments, verbatim at the default values
(tests/deploy/test_helm_chart.py keeps them equal; see those files and docs/deploy/envoy.md "Envoy wiring" for
every choice), plus a stats listener serving /ready and /stats/prometheus (the admin stays on
loopback). Values set pd-extproc's port (one endpoint per worker: the listen port + i),
envoy.statsPort, routing.destination_header and the timeouts below. */}}
{{- define "pd-extproc.envoy" -}}
{{- $destination := .Values.routing.destination_header -}}
{{- $extprocPort := include "pd-extproc.port" .Values.listen -}}
{{- /* The kv-transfer-params handoff asks Envoy to wait up to 2 x handoff.prefill_timeout_seconds + 5 s
(a prefill leg and its retry) for the body answer, and with flow_control.enabled a queued request asks
for flow_control.max_queue_seconds more (Envoy extends one answer's wait once): max_message_timeout is
that, at least the shipped 290 s (at most Envoy's 1 h cap), and the idle timeouts of both listeners and
their routes are 10 s longer, so that neither ends a request waiting that long nor a prefill leg (300 s
at the default, as shipped). */ -}}
{{- $answer := addf (mulf 2 (float64 .Values.handoff.prefill_timeout_seconds)) 5 -}}
{{- $flow := .Values.flow_control -}}
{{- $queue := ternary (float64 $flow.max_queue_seconds) 0.0 $flow.enabled -}}
{{- $maxMessage := maxf 290 (addf $answer $queue) -}}
{{- $idle := include "pd-extproc.decimal" (addf $maxMessage 10) -}}
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
    - envoy_grpc:
        cluster_name: pd_extproc
        retry_policy:
          retry_back_off: {base_interval: 0.25s, max_interval: 1s}

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
          stream_idle_timeout: {{ $idle }}s
          early_header_mutation_extensions:
          - name: envoy.http.early_header_mutation.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
              mutations:
              - remove: {{ $destination }}
              - remove: {{ .Values.routing.prefill_header }}
              - remove: x-encoder-hosts-ports
              - remove: x-kv-cache-source-host-port
              - remove: x-data-parallel-host-port
              - remove: x-data-parallel-rank
              - remove: prefer
              - remove: x-gateway-kv-handoff
          local_reply_config:
            mappers:
            - filter:
                extension_filter:
                  name: envoy.access_loggers.extension_filters.cel
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter
                    expression: "response.code_details.startsWith('pd_extproc_') || response.code_details == 'direct_response'"
            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 413, runtime_key: local_reply.413}}}}
              body_format_override:
                json_format:
                  error:
                    message: "request body too large: the gateway buffers at most 16 MiB (16777216 bytes)"
                    type: invalid_request_error
                    param: null
                    code: request_too_large
            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 431, runtime_key: local_reply.431}}}}
              body_format_override:
                json_format:
                  error:
                    message: "request headers too large: the gateway accepts at most 100 headers and 60 KiB of headers in all (%RESPONSE_CODE_DETAILS%)"
                    type: invalid_request_error
                    param: null
                    code: headers_too_large
            - filter: {response_flag_filter: {flags: [UH]}}
              body_format_override:
                json_format:
                  error:
                    message: "no healthy upstream: the gateway knows no decode endpoint"
                    type: service_unavailable
                    param: null
                    code: no_healthy_upstream
            # The decode engine answered something that is not HTTP (Envoy: upstream protocol error).
            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 502, runtime_key: local_reply.502}}}}
              body_format_override:
                json_format:
                  error:
                    message: "bad upstream response: %LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
                    type: bad_gateway
                    param: null
                    code: upstream_bad_response
            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 503, runtime_key: local_reply.503}}}}
              body_format_override:
                json_format:
                  error:
                    message: "upstream unavailable: %LOCAL_REPLY_BODY%"
                    type: service_unavailable
                    param: null
                    code: upstream_unavailable
            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 504, runtime_key: local_reply.504}}}}
              body_format_override:
                json_format:
                  error:
                    message: "upstream timeout: %LOCAL_REPLY_BODY%"
                    type: gateway_timeout
                    param: null
                    code: upstream_timeout
            - filter: {status_code_filter: {comparison: {op: LE, value: {default_value: 499, runtime_key: local_reply.4xx}}}}
              body_format_override:
                json_format:
                  error:
                    message: "the gateway refused the HTTP request: %LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
                    type: invalid_request_error
                    param: null
                    code: bad_http_request
            - filter: {status_code_filter: {comparison: {op: GE, value: {default_value: 500, runtime_key: local_reply.5xx}}}}
              body_format_override:
                json_format:
                  error:
                    message: "gateway error: %LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
                    type: server_error
                    param: null
                    code: gateway_error
          route_config:
            name: inference
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match:
                  prefix: "/v1/"
                  headers:
                  - {name: {{ $destination }}, present_match: true}
                  - {name: x-gateway-kv-handoff, present_match: true}
                route:
                  cluster: decode
                  timeout: 0s
                  idle_timeout: {{ $idle }}s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset-before-request
                    num_retries: 2
                    per_try_timeout: 0s
                request_headers_to_remove: [x-gateway-kv-handoff]
              - match:
                  prefix: "/v1/"
                  {{- if not .Values.envoy.failOpen }}
                  headers: [{name: {{ $destination }}, present_match: true}]
                  {{- end }}
                route:
                  cluster: decode
                  timeout: 0s
                  idle_timeout: {{ $idle }}s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset
                    num_retries: 2
                    per_try_timeout: 0s
              - match: {prefix: "/v1/"}
                direct_response:
                  status: 503
                  body:
                    inline_string: '{"error":{"message":"the routing server is unavailable or did not answer in time; the request was not forwarded","type":"service_unavailable","param":null,"code":"routing_unavailable"}}'
                response_headers_to_add:
                - header: {key: content-type, value: application/json}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
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
              failure_mode_allow: true
              route_cache_action: CLEAR
              message_timeout: 5s
              max_message_timeout: {{ include "pd-extproc.decimal" $maxMessage }}s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: BUFFERED
                response_header_mode: SKIP
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
              allow_mode_override: true
              metadata_options:
                receiving_namespaces:
                  untyped: [envoy.lb]
                forwarding_namespaces:
                  untyped: [envoy.lb.subset_hint, envoy.lb]
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
          stream_idle_timeout: {{ $idle }}s
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
                  idle_timeout: {{ $idle }}s
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
        {{- range $i := until (int .Values.workers) }}
        - endpoint:
            address:
              socket_address: {address: 127.0.0.1, port_value: {{ add $extprocPort $i }}}
        {{- end }}

  - name: decode
    type: EDS
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options: {idle_timeout: 3s}
        explicit_http_config: {http_protocol_options: {}}
    eds_cluster_config:
      eds_config:
        ads: {}
        resource_api_version: V3
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1000}
    # Passive health (docs/operations.md "Decode ejection"): a host failing 3 requests in a row at the gateway level
    # (502/503/504: refused or reset connections, answers that are not HTTP) or 5 with any 5xx is ejected
    # for 10 s (longer after each new ejection, at most 60 s), at most half the hosts at once. Local-origin
    # errors count as 5xx (split off, Envoy 1.40 counts a non-HTTP answer nowhere). override_host still
    # forwards to a host pd-extproc names, ejected or not: pd-extproc reads the ejection from this
    # Envoy's admin /clusters (envoy_health.admin_url) and stops naming the host.
    outlier_detection:
      consecutive_5xx: 5
      consecutive_gateway_failure: 3
      enforcing_consecutive_gateway_failure: 100
      split_external_local_origin_errors: false
      interval: 1s
      base_ejection_time: 10s
      max_ejection_time: 60s
      max_ejection_percent: 50
      enforcing_success_rate: 0
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
            selected_host_key:
              key: envoy.lb
              path: [{key: x-gateway-destination-endpoint-served}]
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest

  - name: prefill
    type: EDS
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options: {idle_timeout: 3s}
        explicit_http_config: {http_protocol_options: {}}
    eds_cluster_config:
      eds_config:
        ads: {}
        resource_api_version: V3
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 1000}
    # Passive health (docs/operations.md "Decode ejection"): a host failing 3 requests in a row at the gateway level
    # (502/503/504: refused or reset connections, answers that are not HTTP) or 5 with any 5xx is ejected
    # for 10 s (longer after each new ejection, at most 60 s), at most half the hosts at once. Local-origin
    # errors count as 5xx (split off, Envoy 1.40 counts a non-HTTP answer nowhere). override_host still
    # forwards to a host pd-extproc names, ejected or not: pd-extproc reads the ejection from this
    # Envoy's admin /clusters (envoy_health.admin_url) and stops naming the host.
    outlier_detection:
      consecutive_5xx: 5
      consecutive_gateway_failure: 3
      enforcing_consecutive_gateway_failure: 100
      split_external_local_origin_errors: false
      interval: 1s
      base_ejection_time: 10s
      max_ejection_time: 60s
      max_ejection_percent: 50
      enforcing_success_rate: 0
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
