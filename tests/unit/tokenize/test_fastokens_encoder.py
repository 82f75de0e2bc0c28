"""The gateway tokenizer's first fast path: fastokens where it gives the folder's own ids.

The folder is the Llama-3-shaped byte-level BPE trained on the repository's docs
(:mod:`sim.tokenizer_folder`). fastokens reads ``tokenizer.json`` as it is, so it stands in where
tiktoken cannot (merges out of id order); where its ids differ it is refused and the next encoder used.
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ext_proc.metrics import Metrics
from ext_proc.tokenize.check import NotRepresentable
from ext_proc.tokenize.fastokens_encoder import FastokensEncoder, fastokens_encoder
from ext_proc.tokenize.folder import TokenizersEncoder, TokenizerSettings, load_prompt_tokenizer
from ext_proc.tokenize.gateway import GatewayTokenizer
from sim.tokenizer_folder import SPECIAL_TOKENS, write_tokenizer_folder

DOCS = sorted((Path(__file__).parents[3] / "docs").glob("*.md"))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(
        tmp_path_factory.mktemp("tokenizer"), (page.read_text() for page in DOCS), vocab_size=2000
    )


def reference_of(folder: Path) -> TokenizersEncoder:
    return TokenizersEncoder(Tokenizer.from_file(str(folder / "tokenizer.json")))


def test_the_trained_bpe_loads_with_fastokens_and_answers_the_same_ids(folder: Path) -> None:
    fast = load_prompt_tokenizer(TokenizerSettings(str(folder)))
    slow = load_prompt_tokenizer(TokenizerSettings(str(folder), fast_encoders=()))
    assert (fast.encoder, slow.encoder) == ("fastokens", "tokenizers")
    paragraphs = "\n\n".join(page.read_text() for page in DOCS[:3]).split("\n\n")
    turns = [{"role": ("user", "assistant")[i % 2], "content": p} for i, p in enumerate(paragraphs[:30])]
    bodies = [(CHAT, {"messages": turns[:n]}) for n in (1, 10, 30)]
    bodies += [(COMPLETIONS, {"prompt": paragraphs[3]}), (COMPLETIONS, {"prompt": [paragraphs[4], "x"]})]
    for now, (path, body) in enumerate(bodies):  # later chats extend earlier ones: the cache joins them
        assert fast.tokenizer.tokens(body, path, float(now)).ids == slow.tokenizer.tokens(body, path, 0.0).ids
    assert fast.tokenizer.tokens(bodies[2][1], CHAT, 10.0).cached > 0


def test_merges_out_of_id_order_still_load_with_fastokens(folder: Path, tmp_path: Path) -> None:
    """tiktoken merges by token id and is refused here; fastokens merges by rule, as tokenizers does."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    merges = spec["model"]["merges"]
    merges[10], merges[400] = merges[400], merges[10]
    copy = tmp_path / "variant"
    copy.mkdir()
    (copy / "tokenizer_config.json").write_bytes((folder / "tokenizer_config.json").read_bytes())
    (copy / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert load_prompt_tokenizer(TokenizerSettings(str(copy))).encoder == "fastokens"
    tiktoken_only = load_prompt_tokenizer(TokenizerSettings(str(copy), fast_encoders=("tiktoken",)))
    assert tiktoken_only.encoder == "tokenizers"
    assert tiktoken_only.why.startswith("tiktoken: ") and "merges are not in id order" in tiktoken_only.why


def test_ids_that_differ_are_refused(folder: Path) -> None:
    class NoBos:
        """The folder's tokenizer, but adding no BOS (the check compares add_special_tokens too)."""

        def __init__(self) -> None:
            self.inner = reference_of(folder)

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            ids = self.inner.encode(text, add_special_tokens)
            return ids[1:] if add_special_tokens else ids

    spec_text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    with pytest.raises(NotRepresentable, match="ids differ"):
        fastokens_encoder(spec_text, json.loads(spec_text), NoBos(), ["a text"])


def test_a_tokenizer_fastokens_refuses_falls_to_the_next_encoder(folder: Path, tmp_path: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = {"type": "NotAProcessor"}
    with pytest.raises(NotRepresentable, match="fastokens refused it"):
        fastokens_encoder(json.dumps(spec), spec, reference_of(folder), [])


def test_ids_come_as_an_array_and_special_tokens_and_lone_surrogates_match_tokenizers(folder: Path) -> None:
    reference = reference_of(folder)
    spec_text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    fast = fastokens_encoder(spec_text, json.loads(spec_text), reference, [])
    assert isinstance(fast, FastokensEncoder)
    text = f"{SPECIAL_TOKENS[2]}user{SPECIAL_TOKENS[3]}\n\nhi{SPECIAL_TOKENS[4]}"
    for add_special in (False, True):
        ids = fast.encode(text, add_special)
        assert isinstance(ids, array) and ids.tolist() == reference.encode(text, add_special)
    for encoder in (fast, reference):
        with pytest.raises(Exception):  # noqa: B017 (each library raises its own kind)
            encoder.encode("a \ud800 b", False)


def test_the_encoder_in_use_is_logged_and_in_the_metrics(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics(lambda: [])
    caplog.set_level(logging.INFO, logger="ext_proc.tokenize.gateway")
    GatewayTokenizer.open(TokenizerSettings(str(folder)), metrics).close()
    assert "encodes with fastokens" in caplog.text
    value = metrics.registry.get_sample_value
    encoders = ("fastokens", "tiktoken", "tokenizers")
    assert [value("pd_extproc_tokenizer_encoder", {"encoder": e}) for e in encoders] == [1, 0, 0]


@pytest.mark.parametrize(("preset", "threads"), [(None, "1"), ("3", "3")])
def test_fastokens_is_held_to_one_encoder_thread_unless_the_environment_says(
    folder: Path, monkeypatch: pytest.MonkeyPatch, preset: str | None, threads: str
) -> None:
    if preset is None:
        monkeypatch.delenv("FASTOKENS_BPE_THREADS", raising=False)
    else:
        monkeypatch.setenv("FASTOKENS_BPE_THREADS", preset)
    spec_text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    fastokens_encoder(spec_text, json.loads(spec_text), reference_of(folder), [])
    assert os.environ["FASTOKENS_BPE_THREADS"] == threads
