"""The ``routing`` section: the headers of the answer to Envoy, and which requests are disaggregated.

Its check is here too (docs/configuration.md).

It belongs to the handoffs because its headers are their output: every handoff writes the decode and
its fallbacks (the decision picks ``fallback_count`` of them) to ``destination_header`` and a chosen
prefill to ``prefill_header``; ``pd_threshold_tokens`` is the router's gate in front of the handoff. A
leaf module (it imports no handoff module), so that any handoff module, the seam's base included, may
read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ext_proc.checks import ConfigError, in_range


@dataclass(frozen=True)
class RoutingConfig:
    """What the answer to Envoy looks like, and which requests are disaggregated.

    ``pd_threshold_tokens``: prompts estimated below it are routed decode-only (the decode engine
    prefills them itself); 0 disaggregates every prompt. The default, 512, comes from
    ``bench/handoff.py`` (docs/handoffs.md "Conditional disaggregation").
    """

    fallback_count: int = 2
    destination_header: str = "x-gateway-destination-endpoint"
    prefill_header: str = "x-prefiller-host-port"
    pd_threshold_tokens: int = 512

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first key out of range, or two equal headers."""
        in_range("routing.fallback_count", self.fallback_count, 0, 16, kind="an integer")
        for key in ("destination_header", "prefill_header"):
            name = getattr(self, key)
            if not name or name != name.lower() or any(c.isspace() or c == ":" for c in name):
                raise ConfigError(
                    f"routing.{key}: {name!r} is not allowed; use a lower-case HTTP header name"
                )
        if self.destination_header == self.prefill_header:
            raise ConfigError("routing.destination_header and routing.prefill_header must differ")
        if self.pd_threshold_tokens < 0:
            raise ConfigError("routing.pd_threshold_tokens: must be an integer >= 0")
