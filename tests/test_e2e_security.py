"""Security end to end through the real Envoy: what a client sends cannot steer an engine's handoff."""

from __future__ import annotations

import aiohttp
from e2e_harness import stack
from test_security import CHAT, INJECTED


async def test_sidecar_mode_delivers_the_body_without_client_handoff_fields(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        (decode,) = s.decodes.values()
        for body in ({**CHAT, **INJECTED}, CHAT):
            async with session.post(f"{s.gateway.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                assert response.headers["x-seen-prefiller"] in s.prefills
        assert [seen["body"] for seen in decode.requests] == [CHAT, CHAT]
