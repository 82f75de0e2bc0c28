"""The chart's ``flow_control`` values with the real Helm: rendered into pd-extproc's configuration as given
(``pd-extproc check-config`` reads it back), the rendered Envoy waiting long enough for a queued request
and the prefill leg after it, and bad values refused by ``values.schema.json``."""

from __future__ import annotations

from pathlib import Path

from helm_chart import (
    CHART,
    Manifests,
    assert_refused_by_schema,
    effective_config,
    helm_args,
    run_helm,
    template,
)

from ext_proc.handoff.kv_transfer import TIMEOUT_MARGIN_SECONDS

FLOW = {
    "flow_control": {
        "enabled": True,
        "objectives": {"interactive": 10, "standard": 0, "batch": -1, "gold": 100},
        "default_objective": "batch",
        "max_queued_requests": 50,
        "max_queue_seconds": 120.5,
        "max_flows": 8,
        "reserved_requests": 2,
        "engine_priority": True,
        "queue_depth_threshold": 3,
        "kv_cache_threshold": 0.9,
    }
}


def _max_message_seconds(manifests: Manifests) -> float:
    gateway = next(
        entry for entry in manifests.envoy["static_resources"]["listeners"] if entry["name"] == "gateway"
    )
    filters = gateway["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    (ext_proc,) = [f for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
    return float(ext_proc["typed_config"]["max_message_timeout"].removesuffix("s"))


def test_flow_control_values_render_as_given_and_envoy_waits_for_the_queue_and_the_leg(
    helm: Path, tmp_path: Path
):
    manifests = Manifests(template(helm, tmp_path, FLOW))
    effective = effective_config(manifests, tmp_path)
    assert effective["flow_control"] == FLOW["flow_control"]
    wanted = 120.5 + 2 * 120 + TIMEOUT_MARGIN_SECONDS  # the queue, then a prefill leg and its retry
    assert _max_message_seconds(manifests) == wanted
    assert _max_message_seconds(Manifests(template(helm, tmp_path, {}))) == 290  # off: as shipped


def test_bad_flow_control_values_are_refused_by_the_schema(helm: Path, tmp_path: Path):
    values = {"flow_control": {"objectives": {"a": "high"}, "max_queue_seconds": 0, "surprise": 1}}
    result = run_helm(helm, "template", "r", str(CHART), *helm_args(tmp_path, values, ()))
    assert_refused_by_schema(result, ["flow_control", "surprise"])
