"""What a client may send to steer the engines itself: the handoff fields pd-extproc owns and strips
(``INJECTED``, one value of each) and a chat body to add them to (``CHAT``)."""

from __future__ import annotations

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 4}
INJECTED = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_block_ids": [1]},
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 8998,
    "bootstrap_room": 42,
    "routed_dp_rank": 3,
    "disagg_prefill_dp_rank": 1,
}
