"""The ``handoff`` section: how the engines receive a disaggregated request, and its check.

See docs/configuration.md. The ``routing`` section is :mod:`ext_proc.handoff.routing`."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ext_proc.checks import ConfigError, check_url_port, in_range
from ext_proc.handoff.base import FailurePolicy, HandoffMode

MAX_PREFILL_TIMEOUT = 1795.0
"""Upper bound of ``handoff.prefill_timeout_seconds`` (seconds): Envoy caps ``max_message_timeout`` at one
hour, and the kv-transfer-params handoff asks Envoy to wait 2 x this + 5 s (a leg and its retry)."""


@dataclass(frozen=True)
class HandoffConfig:
    """How the engines receive a disaggregated request (see docs/handoffs.md "Handoff modes").

    ``prefill_via``: base URL of the Envoy listener that forwards prefill legs (``""``: connect to
    the prefill endpoint directly). ``prefill_timeout_seconds`` bounds one prefill leg.
    ``default_bootstrap_port``: bootstrap port (SGLang's, or vLLM Mooncake's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``)
    of a prefill without ``bootstrap_port`` metadata.
    ``eject_failed_prefill_seconds``: after a prefill leg fails (not a 4xx), that prefill is no candidate
    for this long (seconds; 0 = never ejected; see ``ext_proc/ejection.py``).
    ``watch_streamed_answers``: with the BUFFERED phases, the engine handoffs have Envoy send a
    streamed answer chunk by chunk to tell a decode's failed KV pull (docs/handoffs.md "KV-load failure
    after a successful leg"); ``False`` spares that per-chunk cost (a failed pull then streams the
    engine's own error).
    """

    mode: HandoffMode = HandoffMode.SIDECAR
    prefill_via: str = ""
    prefill_timeout_seconds: float = 120.0
    on_prefill_failure: FailurePolicy = FailurePolicy.DECODE_ONLY
    default_bootstrap_port: int = 8998
    eject_failed_prefill_seconds: float = 5.0
    watch_streamed_answers: bool = True

    def check(self) -> None:
        """Raise :class:`ConfigError` for a key out of range or a bad ``prefill_via``.

        The error names the first key out of range, or a ``prefill_via`` that is not a base URL."""
        via = urllib.parse.urlsplit(self.prefill_via)
        if self.prefill_via and not (
            via.scheme in ("http", "https") and via.hostname and not via.path.strip("/") and not via.query
        ):
            raise ConfigError(
                f"handoff.prefill_via: {self.prefill_via!r} is not allowed; use a base URL such as "
                "http://127.0.0.1:10001 (no path), or an empty string to connect to prefills directly"
            )
        check_url_port("handoff.prefill_via", self.prefill_via)
        in_range(
            "handoff.prefill_timeout_seconds",
            self.prefill_timeout_seconds,
            0,
            MAX_PREFILL_TIMEOUT,
            low_open=True,
        )
        if not 0 < self.default_bootstrap_port <= 65535:
            raise ConfigError("handoff.default_bootstrap_port: must be a port in 1..65535")
        in_range(
            "handoff.eject_failed_prefill_seconds", self.eject_failed_prefill_seconds, 0, MAX_PREFILL_TIMEOUT
        )
