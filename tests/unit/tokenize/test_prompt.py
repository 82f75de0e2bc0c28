"""The gateway tokenizer: chat and completions prompts in the engine's token ids, its prefix cache, failures.

The tokenizer is trained here on the repository's own docs (nothing is downloaded): a byte-level BPE
shaped like Llama 3's with a Llama-3-style chat template (:mod:`sim.tokenizer_folder`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ext_proc.metrics import Metrics
from ext_proc.tokenize.base import TokenizeFailure, UntokenizedReason
from ext_proc.tokenize.cache import KEY_CHARS, PrefixTokenCache
from ext_proc.tokenize.folder import TokenizerLoadError, TokenizerSettings, load_prompt_tokenizer
from ext_proc.tokenize.gateway import GatewayTokenizer
from ext_proc.tokenize.prompt import PromptTokenizer
from ext_proc.tokenize.template import ChatTemplate, conversation, tool_schemas
from sim.tokenizer_folder import BOS, write_tokenizer_folder

DOCS = sorted((Path(__file__).parents[3] / "docs").glob("*.md"))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>' }}{% endif %}"
)
"""A template that loops over a message's content parts (vLLM's ``openai`` content format)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(
        tmp_path_factory.mktemp("tokenizer"), (page.read_text() for page in DOCS), vocab_size=2000
    )


@pytest.fixture(scope="module")
def raw(folder: Path) -> Tokenizer:
    """The folder's tokenizer itself, to compare with."""
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def fresh(folder: Path, **cache: float) -> PromptTokenizer:
    return load_prompt_tokenizer(TokenizerSettings(str(folder), **cache)).tokenizer  # type: ignore[arg-type]


def with_template(folder: Path, tmp_path: Path, template: str | list[dict[str, str]]) -> Path:
    """A copy of ``folder`` whose tokenizer_config.json has ``template`` as its chat template."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return copy


def failure(tokenizer: PromptTokenizer, body: dict[str, object], path: str = CHAT) -> UntokenizedReason:
    with pytest.raises(TokenizeFailure) as raised:
        tokenizer.tokens(body, path, 0.0)
    return raised.value.reason


# --- chat ---------------------------------------------------------------------------------------------


def test_chat_is_the_rendered_template_tokenized_without_added_specials(folder: Path, raw: Tokenizer) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "  You route requests.  "},
            {"role": "user", "content": "Which prefill holds my prompt?"},
        ],
    }
    rendered = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou route requests.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhich prefill holds my prompt?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = list(fresh(folder).tokens(body, CHAT, 0.0).ids)
    assert ids == raw.encode(rendered, add_special_tokens=False).ids
    assert ids.count(raw.token_to_id(BOS)) == 1  # the template's BOS, none added on top


def test_chat_honours_add_generation_prompt_and_add_special_tokens(folder: Path, raw: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    plain = list(fresh(folder).tokens({"messages": messages, "add_generation_prompt": False}, CHAT, 0.0).ids)
    assert (
        plain
        == raw.encode(
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
            add_special_tokens=False,
        ).ids
    )
    doubled = list(fresh(folder).tokens({"messages": messages, "add_special_tokens": True}, CHAT, 0.0).ids)
    assert doubled[:2] == [raw.token_to_id(BOS)] * 2


def test_chat_content_parts_and_tool_calls_reach_the_template_as_vllm_hands_them(folder: Path) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "x": 1},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"k": "<é>"}'}}
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "1", "name": "f"},
    ]
    as_strings = conversation(messages, "string")
    assert as_strings[0] == {"role": "user", "content": "a\nb"}
    assert as_strings[1]["content"] == ""
    assert as_strings[1]["tool_calls"][0]["function"]["arguments"] == {"k": "<é>"}  # type: ignore[index]
    assert as_strings[2] == {"role": "tool", "content": "ok", "tool_call_id": "1", "name": "f"}
    assert conversation(messages, "openai")[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"k": "<é>"}'  # type: ignore[index]
    # tojson as transformers defines it: no HTML escaping, no ASCII escaping
    rendered = ChatTemplate("{{ messages[1].tool_calls[0].function.arguments | tojson }}").render(
        {"messages": as_strings}
    )
    assert rendered == '{"k": "<é>"}'


def test_tools_reach_the_template_as_vllm_dumps_them(folder: Path, tmp_path: Path) -> None:
    tools = [
        {"type": "function", "function": {"strict": True, "parameters": {"type": "object"}, "name": "f"}}
    ]
    assert tool_schemas(tools) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert list(tool_schemas(tools)[0]["function"]) == ["name", "description", "parameters", "strict"]  # type: ignore[arg-type]
    tokenizer = fresh(with_template(folder, tmp_path, "{{ tools | tojson }}{{ messages[0].content }}"))
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    rendered = (
        '[{"type": "function", "function": {"name": "f", "description": null, '
        '"parameters": {"type": "object"}, "strict": true}}]x'
    )
    assert (
        tokenizer.tokens(body, CHAT, 0.0).ids
        == tokenizer.tokens({"prompt": rendered, "add_special_tokens": False}, COMPLETIONS, 0.0).ids
    )
    assert failure(tokenizer, {**body, "tools": [{"type": "function"}]}) == UntokenizedReason.UNSUPPORTED


def test_named_templates_and_chat_template_jinja_are_found_as_transformers_finds_them(
    folder: Path, raw: Tokenizer, tmp_path: Path
) -> None:
    named = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T"},
    ]
    tokenizer = fresh(with_template(folder, tmp_path, named))
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert list(tokenizer.tokens(body, CHAT, 0.0).ids) == raw.encode("Dx", add_special_tokens=False).ids
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert (
        list(tokenizer.tokens({**body, "tools": tools}, CHAT, 0.0).ids)
        == raw.encode("T", add_special_tokens=False).ids
    )
    (tmp_path / "copy" / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert (
        list(fresh(tmp_path / "copy").tokens(body, CHAT, 0.0).ids)
        == raw.encode("Jx", add_special_tokens=False).ids
    )


def test_the_content_format_follows_the_template(folder: Path, raw: Tokenizer, tmp_path: Path) -> None:
    assert ChatTemplate(CHATML).content_format == "openai"
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").content_format == "string"
    chatml = fresh(with_template(folder, tmp_path, CHATML))
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
        ]
    }
    rendered = (
        "<|start_header_id|>user<|end_header_id|>xy<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    )
    assert list(chatml.tokens(body, CHAT, 0.0).ids) == raw.encode(rendered, add_special_tokens=False).ids


def test_transformers_template_conventions() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {% generation %}[{{ m.content }}]{% endgeneration %}\n"
        "{% endfor %}{{ strftime_now('%Y')[:2] }}"
    )
    # trim_blocks and lstrip_blocks: the block tags leave no whitespace behind; loopcontrols; generation
    assert template.render({"messages": [{"content": c} for c in "abc"]}) == "[a][b]20"


# --- completions --------------------------------------------------------------------------------------


def test_completions_text_gets_the_post_processors_specials(folder: Path, raw: Tokenizer) -> None:
    tokenizer = fresh(folder)
    text = "The prefix index keys blocks by token ids."
    assert list(tokenizer.tokens({"prompt": text}, COMPLETIONS, 0.0).ids) == raw.encode(text).ids
    assert tokenizer.tokens({"prompt": text}, COMPLETIONS, 0.0).ids[0] == raw.token_to_id(BOS)
    unadorned = list(tokenizer.tokens({"prompt": text, "add_special_tokens": False}, COMPLETIONS, 0.0).ids)
    assert unadorned == raw.encode(text, add_special_tokens=False).ids
    two = list(tokenizer.tokens({"prompt": [text, "more"]}, COMPLETIONS, 0.0).ids)
    assert two == raw.encode(text).ids + raw.encode("more").ids
    assert list(tokenizer.tokens({"input": text}, "/v1/embeddings", 0.0).ids) == raw.encode(text).ids


def test_token_id_prompts_are_used_as_given(folder: Path) -> None:
    tokenizer = fresh(folder)
    assert tokenizer.tokens({"prompt": [5, 6, 7]}, COMPLETIONS, 0.0).ids == [5, 6, 7]
    assert tokenizer.tokens({"prompt": [[5, 6], [7]]}, "/v1/completions?x=1", 0.0).ids == [5, 6, 7]


# --- the prefix cache ---------------------------------------------------------------------------------

LINES = [line for page in DOCS for line in page.read_text().splitlines() if line.strip()][:400]
TRICKY = ["", " ", "  ", "\n", "\n\n", "word", " word", "é", "ü ", "123", "1234", "!!", "'s", "\t"]


def utterance(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(TRICKY)) + draw(st.sampled_from(LINES)) + draw(st.sampled_from(TRICKY))


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """A system prompt, then user and assistant turns with ragged whitespace at their edges."""
    turns = [{"role": "system", "content": utterance(draw)}]
    for index in range(draw(st.integers(1, 6))):
        turns.append({"role": ("user", "assistant")[index % 2], "content": utterance(draw)})
    return turns


@pytest.mark.slow  # 60 conversations through three templates: `make test-fast` leaves it out
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations(), template=st.sampled_from(["llama3", "bare", "parts"]))
def test_cached_tokens_equal_a_full_tokenization_turn_after_turn(
    folder: Path,
    raw: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
    turns: list[dict[str, str]],
    template: str,
) -> None:
    """Each turn extends the last; the cached answer is always what tokenizing the whole text gives."""
    if template != "llama3":  # bare: no special token between messages, boundaries may split words
        source = CHATML if template == "parts" else "{% for m in messages %}{{ m.content }}{% endfor %}"
        folder = with_template(folder, tmp_path_factory.mktemp(template), source)
    cached, uncached = fresh(folder), fresh(folder, cache_entries=0)
    for end in range(2, len(turns) + 1):
        body = {"messages": turns[:end]}
        ids = cached.tokens(body, CHAT, float(end)).ids
        assert ids == uncached.tokens(body, CHAT, float(end)).ids
        if template == "bare":  # the rendered text is the contents joined: the whole of it tokenized
            whole = "".join(turn["content"] for turn in turns[:end])
            assert list(ids) == raw.encode(whole, add_special_tokens=False).ids


def test_a_later_turn_reuses_the_earlier_turns_tokens(folder: Path) -> None:
    tokenizer = fresh(folder)
    turns = [{"role": "system", "content": LINES[0]}, {"role": "user", "content": LINES[1]}]
    first = tokenizer.tokens({"messages": turns}, CHAT, 0.0)
    assert first.cached == 0
    longer = [*turns, {"role": "assistant", "content": LINES[2]}, {"role": "user", "content": LINES[3]}]
    second = tokenizer.tokens({"messages": longer}, CHAT, 1.0)
    assert second.cached == len(first.ids)  # the whole first prompt, generation prompt included
    assert second.ids[: len(first.ids)] == first.ids


def test_content_parts_have_boundaries_too(folder: Path, raw: Tokenizer, tmp_path: Path) -> None:
    tokenizer = fresh(with_template(folder, tmp_path, CHATML))
    turns = [{"role": "user", "content": [{"type": "text", "text": LINES[0]}, {"type": "text", "text": "!"}]}]
    first = tokenizer.tokens({"messages": turns}, CHAT, 0.0)
    other = tokenizer.tokens(
        {"messages": [*turns, {"role": "user", "content": "another question"}]}, CHAT, 1.0
    )
    header = len(raw.encode("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False).ids)
    assert other.cached == header + len(raw.encode(LINES[0] + "!", add_special_tokens=False).ids)
    assert other.cached < len(first.ids)  # up to the end of the first message's last part


def test_a_shared_system_prompt_is_tokenized_once(folder: Path, raw: Tokenizer) -> None:
    tokenizer = fresh(folder)
    system = {"role": "system", "content": " ".join(LINES[:20])}
    tokenizer.tokens({"messages": [system, {"role": "user", "content": "first tenant"}]}, CHAT, 0.0)
    other = tokenizer.tokens({"messages": [system, {"role": "user", "content": "second tenant"}]}, CHAT, 1.0)
    system_tokens = len(
        raw.encode(f"{BOS}<|start_header_id|>system<|end_header_id|>\n\n{system['content']}").ids
    )
    assert other.cached == system_tokens - 1  # up to the end of its content; the BOS is counted once


def test_a_boundary_inside_a_token_falls_back_to_the_whole_text(
    folder: Path, raw: Tokenizer, tmp_path: Path
) -> None:
    tokenizer = fresh(with_template(folder, tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}"))
    tokenizer.tokens({"messages": [{"role": "user", "content": "the prefi"}]}, CHAT, 0.0)
    joined = [{"role": "user", "content": "the prefi"}, {"role": "user", "content": "x index"}]
    answer = tokenizer.tokens({"messages": joined}, CHAT, 1.0)
    assert answer.cached == 0
    assert list(answer.ids) == raw.encode("the prefix index", add_special_tokens=False).ids


def test_cached_prefixes_expire_after_their_ttl(folder: Path) -> None:
    tokenizer = fresh(folder, cache_ttl_s=60.0)
    turns = [{"role": "system", "content": LINES[0]}, {"role": "user", "content": LINES[1]}]
    tokenizer.tokens({"messages": turns}, CHAT, 0.0)
    longer = {"messages": [*turns, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}
    assert tokenizer.tokens(longer, CHAT, 59.0).cached > 0
    assert tokenizer.tokens({"messages": [*turns, {"role": "user", "content": "z"}]}, CHAT, 200.0).cached == 0


def test_the_cache_keeps_its_bounds() -> None:
    cache = PrefixTokenCache(max_entries=2, max_tokens=10, ttl_s=5.0)
    cache.put("a", 1, array("I", [1, 2, 3]), now=0.0)
    cache.put("b", 1, array("I", [1, 2, 3]), now=0.0)
    assert cache.get("a", 1, now=1.0) is not None  # a is now the most recent
    cache.put("c", 1, array("I", [1, 2, 3]), now=1.0)
    assert (len(cache), cache.tokens) == (2, 6)
    assert cache.get("b", 1, now=1.0) is None  # the least recent went first
    cache.put("d", 1, array("I", list(range(8))), now=1.0)
    assert (len(cache), cache.tokens) == (1, 8)  # ten tokens at most
    cache.put("e", 1, array("I", list(range(11))), now=1.0)
    assert cache.get("e", 1, now=1.0) is None  # longer than the whole cache: not held
    assert cache.get("d", 1, now=6.0) is None  # unused for ttl_s
    assert (len(cache), cache.tokens) == (0, 0)


def test_the_cache_answers_only_for_the_same_whole_text() -> None:
    """Two prefixes of one length and one ending share a key: the held one answers only for its text."""
    cache = PrefixTokenCache(max_entries=8, max_tokens=100, ttl_s=5.0)
    ending = "x" * KEY_CHARS
    cache.put("first " + ending + " and more", 6 + KEY_CHARS, array("I", [1, 2]), now=0.0)
    assert cache.get("first " + ending + " then", 6 + KEY_CHARS, now=1.0) == array("I", [1, 2])
    assert cache.get("other " + ending + " and more", 6 + KEY_CHARS, now=1.0) is None
    assert cache.get("first " + ending, 5 + KEY_CHARS, now=1.0) is None  # another length


# --- failures -----------------------------------------------------------------------------------------


def test_bodies_the_gateway_cannot_render_as_the_engine_says_why(folder: Path) -> None:
    tokenizer = fresh(folder)
    image = {"type": "image_url", "image_url": {"url": "data:"}}
    assert (
        failure(tokenizer, {"messages": [{"role": "user", "content": [image]}]})
        == UntokenizedReason.UNSUPPORTED
    )
    assert failure(
        tokenizer, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}
    ) == (UntokenizedReason.UNSUPPORTED)
    assert failure(tokenizer, {"prompt": "x"}, "/v1/responses") == UntokenizedReason.UNSUPPORTED
    assert failure(tokenizer, {"messages": []}) == UntokenizedReason.NO_PROMPT
    assert failure(tokenizer, {"model": "m"}, COMPLETIONS) == UntokenizedReason.NO_PROMPT
    assert failure(tokenizer, {"prompt": [1, "x"]}, COMPLETIONS) == UntokenizedReason.UNSUPPORTED
    assert (
        failure(tokenizer, {"messages": [{"role": "narrator", "content": "x"}]}) == UntokenizedReason.TEMPLATE
    )
    assert failure(tokenizer, {"prompt": "\ud800"}, COMPLETIONS) == UntokenizedReason.TOKENIZER


def test_a_folder_without_a_chat_template_still_tokenizes_completions(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    tokenizer = fresh(tmp_path)
    assert tokenizer.tokens({"prompt": "x"}, COMPLETIONS, 0.0).ids
    assert failure(tokenizer, {"messages": [{"role": "user", "content": "x"}]}) == UntokenizedReason.TEMPLATE


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "tokenizer.json").unlink(),
        lambda d: (d / "tokenizer.json").write_text("{not json"),
        lambda d: (d / "tokenizer_config.json").write_text("{not json"),
        lambda d: (d / "chat_template.jinja").write_text("{% for %}"),
    ],
    ids=["missing", "not-a-tokenizer", "bad-config", "bad-template"],
)
def test_an_unusable_folder_is_a_load_error(folder: Path, tmp_path: Path, damage) -> None:
    copy = with_template(folder, tmp_path, "{{ messages }}")
    damage(copy)
    with pytest.raises(TokenizerLoadError, match=str(copy)):
        load_prompt_tokenizer(TokenizerSettings(str(copy)))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda d: shutil.rmtree(d), "no such folder"),
        (lambda d: (shutil.rmtree(d), d.write_text("a file"))[-1], "not a folder"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json in it"),
        (lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").mkdir())[-1], "cannot read"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "not a tokenizer"),
    ],
    ids=["no-folder", "a-file", "no-tokenizer-json", "unreadable", "not-a-tokenizer"],
)
def test_an_unusable_folder_says_what_is_wrong(folder: Path, tmp_path: Path, damage, says: str) -> None:
    copy = with_template(folder, tmp_path, "{{ messages }}")
    damage(copy)
    with pytest.raises(TokenizerLoadError, match=says):
        load_prompt_tokenizer(TokenizerSettings(str(copy)))


class Recorder:
    """Counts what the gateway tokenizer reports."""

    def __init__(self) -> None:
        self.done: list[tuple[int, int]] = []
        self.reasons: list[str] = []
        self.encoder: str | None = None

    def tokenized(self, seconds: float, tokens: int, cached: int) -> None:
        assert seconds >= 0
        self.done.append((tokens, cached))

    def untokenized(self, reason: str) -> None:
        self.reasons.append(reason)

    def tokenizer_encoder(self, encoder: str | None) -> None:
        self.encoder = encoder


async def test_the_gateway_tokenizes_off_the_event_loop(folder: Path, raw: Tokenizer) -> None:
    recorder = Recorder()
    gateway = GatewayTokenizer.open(TokenizerSettings(str(folder)), recorder)
    assert gateway.tokenizer is not None
    threads: list[str] = []
    tokens = gateway.tokenizer.tokens
    gateway.tokenizer.tokens = lambda *a: (threads.append(threading.current_thread().name), tokens(*a))[1]  # type: ignore[method-assign]
    try:
        text = "an off-loop prompt"
        ids, again = await asyncio.gather(
            gateway.prompt_tokens({"prompt": text}, COMPLETIONS),
            gateway.prompt_tokens({"prompt": text}, COMPLETIONS),
        )
        assert ids == again and list(ids) == raw.encode(text).ids
        assert recorder.done == [(len(ids), 0), (len(ids), len(ids) - 1)]  # the second from the cache
        assert threads and all(name.startswith("tokenizer") for name in threads)
        assert await gateway.prompt_tokens({"messages": [{"role": "narrator", "content": "x"}]}, CHAT) is None
        assert recorder.reasons == ["template"]
    finally:
        gateway.close()


async def test_a_missing_folder_answers_none_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    gateway = GatewayTokenizer.open(TokenizerSettings(str(tmp_path / "absent")), recorder)
    try:
        assert gateway.tokenizer is None
        assert "tokenizer folder unusable" in caplog.text
        assert await gateway.prompt_tokens({"prompt": "x"}, COMPLETIONS) is None
        assert await gateway.prompt_tokens({"prompt": "y"}, COMPLETIONS) is None
        assert recorder.reasons == ["no_tokenizer", "no_tokenizer"]
    finally:
        gateway.close()


async def test_the_metrics_count_tokens_by_source_and_fallbacks_by_reason(folder: Path) -> None:
    metrics = Metrics(lambda: [])
    gateway = GatewayTokenizer.open(TokenizerSettings(str(folder)), metrics)
    try:
        ids = await gateway.prompt_tokens({"prompt": "counted"}, COMPLETIONS)
        await gateway.prompt_tokens({"prompt": "counted"}, COMPLETIONS)
        await gateway.prompt_tokens({"prompt": "x"}, "/v1/responses")
    finally:
        gateway.close()
    assert ids is not None
    value = metrics.registry.get_sample_value
    assert value("pd_extproc_tokenize_seconds_count") == 2
    assert value("pd_extproc_tokenize_tokens_total", {"source": "cache"}) == len(ids) - 1
    assert value("pd_extproc_tokenize_tokens_total", {"source": "tokenizer"}) == len(ids) + 1
    assert value("pd_extproc_tokenize_fallbacks_total", {"reason": "unsupported"}) == 1
