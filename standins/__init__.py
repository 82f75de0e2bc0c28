"""Stand-ins for what pd-extproc talks to, shared by the tests and the benchmarks.

:mod:`standins.backends` (echo, scripted-prefill, broken and keep-alive engines, a bootstrap server),
:mod:`standins.fake_kube_api` (a Kubernetes API server: list, watch, selectors) with
:mod:`standins.kube_objects` (the pods and InferencePools it serves), :mod:`standins.shapes` (Envoy in
each gateway's shape of ``tests/deploy/gateway_shapes/`` over such engines), :mod:`standins.certs`
(TLS material from ``openssl``), :mod:`standins.metrics` (pd-extproc's counters read back) and
:mod:`standins.otlp` (an OpenTelemetry collector: the OTLP gRPC trace service). Part of
the development install (``pip install -e .``), never of the image; nothing in ``ext_proc``, ``sim`` or
``rig`` imports it.
"""
