"""The ``flow_control`` section as a file gives it: the objectives mapping, the default objective and the
bounds, each error naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.checks import ConfigError
from ext_proc.config import as_dict, load_config


def load(tmp_path: Path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config(str(path), environ={})


def test_the_section_as_the_issue_writes_it(tmp_path):
    config = load(
        tmp_path,
        "flow_control:\n  enabled: true\n"
        "  objectives: {interactive: 10, standard: 0, batch: -1, premium: 20}\n"
        "  default_objective: batch\n  max_queued_requests: 10\n  max_queue_seconds: 2.5\n",
    )
    flow = config.flow_control
    assert flow.enabled and flow.objectives == {"interactive": 10, "standard": 0, "batch": -1, "premium": 20}
    assert (flow.default_objective, flow.max_queued_requests, flow.max_queue_seconds) == ("batch", 10, 2.5)
    assert load_config(None, as_dict(config), environ={}).flow_control == flow  # check-config round trip


def test_off_by_default():
    assert not load_config(None, environ={}).flow_control.enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("objectives: {a: high}", "flow_control.objectives: {'a': 'high'} is not allowed; use a mapping"),
        ("objectives: [a, b]", "flow_control.objectives: ['a', 'b'] is not allowed; use a mapping"),
        ("objectives: {a: true}", "flow_control.objectives: {'a': True} is not allowed"),
        ("objectives: {a: 10000000}", "flow_control.objectives.a: must be an integer in [-1000000, 1000000]"),
        ("objectives: {a: 1}", "flow_control.default_objective: 'standard' is not one of"),
        ("default_objective: gold", "flow_control.default_objective: 'gold' is not one of"),
        ("max_queued_requests: 0", "flow_control.max_queued_requests: must be an integer in [1, 1000000]"),
        ("max_queue_seconds: 0", "flow_control.max_queue_seconds: must be a number in (0, 3600]"),
        ("max_flows: 0", "flow_control.max_flows: must be an integer in [1, 100000]"),
        ("kv_cache_threshold: 1.5", "flow_control.kv_cache_threshold: must be a number in (0, 1]"),
        (
            "queue_depth_threshold: 0",
            "flow_control.queue_depth_threshold: must be an integer in [1, 1000000]",
        ),
        ("engine_priority: true", "flow_control.engine_priority: needs flow_control.enabled"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, f"flow_control:\n  {text}\n")
    assert str(info.value).startswith(message), str(info.value)
