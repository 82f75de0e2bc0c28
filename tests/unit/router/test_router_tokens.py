"""Router with the prompt's token ids: exact charges and threshold, the chain over them, when to ask."""

from __future__ import annotations

import json
import threading
from array import array
from pathlib import Path

from builders import CHAT_META, DEFAULT_MAX_TOKENS, P1, PREFILL, endpoint, make_router, registry_of

from ext_proc.affinity import Policy
from ext_proc.handoff.sidecar import SidecarHandoff
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused, RequestMeta, Routed
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored, EventBatch
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.router import BodyRequest, Router, RouterSettings
from ext_proc.tokenize import gateway as gateway_module
from ext_proc.tokenize.folder import TokenizerLoadError, TokenizerSettings

P2 = "10.0.0.2:8000"
D1 = "10.0.1.1:8000"
B = 16


def chat_body(content: str = "x" * 40) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def read(router: Router, raw: bytes, meta: RequestMeta = CHAT_META) -> BodyRequest:
    request = router.read(raw, meta)
    assert isinstance(request, BodyRequest), request
    return request


def routed(result: object) -> Routed:
    assert isinstance(result, Routed), result
    return result


def charges(router: Router) -> dict[tuple[str, str], int]:
    return {(s.role.value, s.address): s.active_tokens for s in router.registry.endpoints()}


def test_known_tokens_are_charged_at_their_exact_count() -> None:
    router = make_router([endpoint(P1)], [endpoint(D1)])
    request = read(router, chat_body("x" * 40))  # estimated 10 prompt tokens
    assert request.info.prompt_tokens == 10
    result = routed(router.route(request, tokens=list(range(37))))
    assert charges(router) == {("prefill", P1): 37, ("decode", D1): 37 + DEFAULT_MAX_TOKENS}
    result.lease.release()
    routed(router.route(request))  # unknown: the estimate, as route_body charges
    assert charges(router) == {("prefill", P1): 10, ("decode", D1): 10 + DEFAULT_MAX_TOKENS}


def test_the_disaggregation_threshold_compares_the_exact_count() -> None:
    registry = registry_of([endpoint(P1)], [endpoint(D1)], 10_000.0)
    router = Router(
        RouterSettings(DEFAULT_MAX_TOKENS, pd_threshold_tokens=20),
        registry=registry,
        policy=Policy(),
        handoff=SidecarHandoff("x-dest", PREFILL),
        metrics=Metrics(registry.endpoints),
    )
    request = read(router, chat_body("x" * 40))  # estimated 10: below the threshold
    below = routed(router.route(request))
    assert PREFILL not in dict(below.instructions.set_headers)
    above = routed(router.route(request, tokens=[1] * 20))  # exactly 20: at it
    assert dict(above.instructions.set_headers)[PREFILL] == P1


def kv_router(tokenizer: str = "") -> Router:
    prefix = PrefixSettings(B, 100, source="kv-events", tokenizer=tokenizer)
    return make_router([endpoint(P1), endpoint(P2)], [endpoint(D1)], prefix=prefix, prefix_weight=0.5)


def test_the_events_index_is_looked_up_by_the_chain_of_the_tokens() -> None:
    """A text prompt whose token ids an engine reported holding goes to that engine; its text alone
    matches nothing there."""
    router = kv_router()
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    ids = [t % 50 + 1 for t in range(4 * B)]
    source.index.apply(
        P2, EventBatch(0, 0.0, None, (BlockStored((1, 2, 3, 4), None, tuple(ids), B),)), 0.0, False
    )
    source.clock = lambda: 1.0
    request = read(router, chat_body("a text whose ids the gateway tokenizer gave"))
    assert dict(routed(router.route(request, tokens=[*ids, 9])).instructions.set_headers)[PREFILL] == P2
    as_tokenized = array("I", [*ids, 9])  # as the gateway tokenizer hands them on
    assert dict(routed(router.route(request, tokens=as_tokenized)).instructions.set_headers)[PREFILL] == P2
    assert dict(routed(router.route(request)).instructions.set_headers)[PREFILL] == P1  # tie: the first


def test_tokens_are_wanted_for_text_prompts_of_the_tokenized_paths_with_a_tokenizer(tmp_path) -> None:
    without = kv_router()
    assert not without.wants_tokens(read(without, chat_body()))
    router = kv_router(str(tmp_path / "missing"))  # configured, does not load: still asked (and counted)
    assert router.live.tokenizer is not None and router.live.tokenizer.tokenizer is None
    assert router.wants_tokens(read(router, chat_body()))
    text = json.dumps({"model": "m", "prompt": "hello"}).encode()
    ids = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
    assert router.wants_tokens(read(router, text, RequestMeta("/v1/completions")))
    assert router.wants_tokens(read(router, text, RequestMeta("/v1/embeddings?x=1")))
    assert not router.wants_tokens(read(router, ids, RequestMeta("/v1/completions")))  # used as given
    assert not router.wants_tokens(read(router, text, RequestMeta("/v1/other")))


def test_the_tokenizer_follows_the_prefix_settings(tmp_path) -> None:
    router = kv_router(str(tmp_path / "a"))
    first = router.live.tokenizer
    router.live.set_prefix(PrefixSettings(B, 100, source="kv-events", tokenizer=str(tmp_path / "a")))
    assert router.live.tokenizer is first  # the same folder: kept
    router.live.set_prefix(PrefixSettings(B, 100, source="kv-events", tokenizer=str(tmp_path / "b")))
    assert router.live.tokenizer is not first and router.live.tokenizer is not None
    router.live.set_prefix(None)
    assert router.live.tokenizer is None
    router.live.close()


async def test_a_reload_that_removes_the_tokenizer_leaves_a_pending_request_untokenized(tmp_path) -> None:
    router = kv_router(str(tmp_path / "missing"))
    request = read(router, chat_body())
    router.live.set_prefix(PrefixSettings(B, 100, source="kv-events"))
    assert await router.prompt_tokens(request) is None
    assert not isinstance(router.route(request), Refused)


async def test_a_folder_changed_again_while_loading_is_superseded(tmp_path, monkeypatch) -> None:
    """Only the folder configured last is used; the load of one changed away from is dropped."""
    released = {name: threading.Event() for name in "bc"}

    def load(settings: TokenizerSettings) -> TokenizerLoadError:
        released[Path(settings.folder).name].wait(10)
        return TokenizerLoadError(settings.folder)

    router = kv_router(str(tmp_path / "a"))
    first = router.live.tokenizer
    monkeypatch.setattr(gateway_module, "load_folder", load)
    router.live.set_prefix(PrefixSettings(B, 100, source="kv-events", tokenizer=str(tmp_path / "b")))
    loading_b = router.live.tokenizer_opening
    router.live.set_prefix(PrefixSettings(B, 100, source="kv-events", tokenizer=str(tmp_path / "c")))
    assert (loading_b is not None and loading_b.cancelled()) or loading_b.cancelling()
    assert router.live.tokenizer is first  # the old one serves until the new one is loaded
    released["c"].set()
    opening = router.live.tokenizer_opening
    assert opening is not None
    await opening
    assert router.live.tokenizer is not first and router.live.tokenizer_opening is None
    released["b"].set()
    router.live.close()
