"""A simulated vLLM prefill/decode (PD) engine for testing pd-extproc without GPUs.

Modules: :mod:`sim.config` (dataclasses), :mod:`sim.clock` (model time), :mod:`sim.engine`
(timing model and continuous-batching scheduler), :mod:`sim.kv` (KV transfer model, shared link,
EDS group map), :mod:`sim.metrics` (vLLM-named Prometheus metrics), :mod:`sim.protocol` (request
parsing and OpenAI response shapes), :mod:`sim.server` (aiohttp app), :mod:`sim.cluster` (many
engines in one process) and :mod:`sim.cli` (the ``sim`` subcommand).
"""
