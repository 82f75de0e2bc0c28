"""Real vLLM engines on this machine's CPU: the reference the simulator is checked against.

:mod:`rig.venv` installs vLLM for CPU into a cached virtual environment of its own,
:mod:`rig.model` writes the tiny Llama the engines serve, :mod:`rig.engine` starts one engine the
way a user starts vLLM (``python -m vllm.entrypoints.openai.api_server``) and reads its
``/metrics``, and :mod:`rig.cluster` runs pdGroups of NixlConnector prefill/decode pairs behind
the shipped Envoy bootstrap and ``pd-extproc serve --handoff kv-transfer-params``. Used by
``make test-vllm`` (``tests/vllm/``) and ``pd-extproc demo --engines vllm``.
"""
