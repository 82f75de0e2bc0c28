"""The ``shared_state`` section: its checks, and that no message shows a NATS password or token."""

from __future__ import annotations

import pytest

from ext_proc.checks import ConfigError
from ext_proc.config import load_config
from ext_proc.shared.config import redacted


@pytest.mark.parametrize(
    ("overrides", "environ", "says"),
    [
        ({"shared_state.kind": "nats"}, {}, "shared_state.nats.url: required with kind nats"),
        ({"shared_state.nats.url": "http://u:s3cret@h:4222"}, {}, "'http://***@h:4222' is not allowed"),
        (
            {},
            {"PD_EXTPROC_NATS_URL": "nats://u:s3cret@h:99999"},
            "PD_EXTPROC_NATS_URL (shared_state.nats.url)",
        ),
        ({"shared_state.nats.subject_prefix": "a b"}, {}, "shared_state.nats.subject_prefix"),
        ({"shared_state.nats.subject_prefix": "pool.>"}, {}, "shared_state.nats.subject_prefix"),
        ({"shared_state.heartbeat_seconds": 10.0}, {}, "shared_state.peer_timeout_seconds"),
        ({"shared_state.nats.tls.cert": "c.pem"}, {}, "cert and key go together"),
        ({"shared_state.sync_answer_seconds": 0.0}, {}, "shared_state.sync_answer_seconds: must be"),
        ({"shared_state.sync_answer_seconds": 2.0}, {}, "is more than sync_wait_seconds (1)"),
        ({"shared_state.sync_max_waiting": 0}, {}, "shared_state.sync_max_waiting: must be an integer"),
    ],
)
def test_a_bad_section_is_refused_naming_the_key_and_never_the_password(
    overrides: dict[str, object], environ: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides, environ=environ)
    assert says in str(raised.value)
    assert "s3cret" not in str(raised.value)


def test_the_url_and_token_come_from_the_environment() -> None:
    environ = {"PD_EXTPROC_NATS_URL": "nats://u:p@nats:4222", "PD_EXTPROC_NATS_TOKEN": "t0k"}
    nats = load_config(None, {"shared_state.kind": "nats"}, environ=environ).shared_state.nats
    assert (nats.url, nats.token) == ("nats://u:p@nats:4222", "t0k")


def test_redacted_keeps_hosts_and_drops_credentials() -> None:
    assert (
        redacted("nats://u:p@a:4222, tls://tok@b:4223,nats://c:4222")
        == "nats://***@a:4222,tls://***@b:4223,nats://c:4222"
    )


def test_replicas_of_one_pool_derive_one_hashing_key_and_other_pools_another() -> None:
    def key(**overrides: object) -> bytes:
        base = {"shared_state.kind": "nats", "shared_state.nats.url": "nats://u:p@h:4222"}
        return load_config(None, base | overrides, environ={}).shared_state.nats.key()

    assert key() == key()
    assert key() != key(**{"shared_state.nats.subject_prefix": "other"})
    assert key() != key(**{"shared_state.nats.url": "nats://u:q@h:4222"})
    assert key(**{"shared_state.nats.hash_key": "k"}) == key(
        **{"shared_state.nats.hash_key": "k", "shared_state.nats.subject_prefix": "x"}
    )
