"""pd-extproc: an Envoy ext_proc server routing OpenAI-compatible traffic in P/D disaggregated clusters.

It routes in prefill/decode disaggregated clusters, keeping the KV-cache transfer inside the
prefill's ``pdGroupID`` group."""

__version__ = "0.1.0"
