"""pd-extproc: an Envoy ext_proc server that routes OpenAI-compatible traffic in prefill/decode
disaggregated clusters, keeping the KV-cache transfer inside the prefill's ``pdGroupID`` group."""

__version__ = "0.1.0"
