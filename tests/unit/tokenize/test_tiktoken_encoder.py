"""The gateway tokenizer's tiktoken path: tiktoken where it gives the folder's ids, ``tokenizers`` elsewhere.

The folder is the Llama-3-shaped byte-level BPE trained on the repository's docs
(:mod:`sim.tokenizer_folder`); variants of its ``tokenizer.json`` that tiktoken cannot represent, or
that it represents with other ids, must load with ``tokenizers``. fastokens, tried before tiktoken by
default, is left out here (:data:`TIKTOKEN`; its own tests: ``test_fastokens_encoder.py``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ext_proc.metrics import Metrics
from ext_proc.tokenize.check import NotRepresentable, check_corpus
from ext_proc.tokenize.folder import TokenizersEncoder, TokenizerSettings, load_prompt_tokenizer
from ext_proc.tokenize.gateway import GatewayTokenizer
from ext_proc.tokenize.tiktoken_encoder import tiktoken_encoder
from sim.tokenizer_folder import SPECIAL_TOKENS, write_tokenizer_folder

DOCS = sorted((Path(__file__).parents[3] / "docs").glob("*.md"))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIKTOKEN = {"fast_encoders": ("tiktoken",)}
"""Settings that try tiktoken alone before ``tokenizers``."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(
        tmp_path_factory.mktemp("tokenizer"), (page.read_text() for page in DOCS), vocab_size=2000
    )


def variant(folder: Path, tmp_path: Path, spec: dict[str, object]) -> Path:
    """A copy of ``folder`` whose tokenizer.json is ``spec``."""
    copy = tmp_path / "variant"
    copy.mkdir()
    (copy / "tokenizer_config.json").write_bytes((folder / "tokenizer_config.json").read_bytes())
    (copy / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return copy


def spec_of(folder: Path) -> dict[str, object]:
    return json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))


def test_the_trained_bpe_loads_with_tiktoken_and_answers_the_same_ids(folder: Path) -> None:
    fast = load_prompt_tokenizer(TokenizerSettings(str(folder), **TIKTOKEN))
    slow = load_prompt_tokenizer(TokenizerSettings(str(folder), fast_encoders=()))
    assert (fast.encoder, slow.encoder) == ("tiktoken", "tokenizers")
    text = "\n\n".join(page.read_text() for page in DOCS[:3])
    paragraphs = text.split("\n\n")
    turns = [
        {"role": ("user", "assistant")[i % 2], "content": p} for i, p in enumerate(paragraphs[:40], start=1)
    ]
    bodies = [
        (CHAT, {"messages": [{"role": "system", "content": paragraphs[0]}, *turns[:n]]})
        for n in (1, 9, 20, 40)
    ]
    bodies += [(COMPLETIONS, {"prompt": text}), (COMPLETIONS, {"prompt": [text[:500], text[500:900]]})]
    bodies += [(COMPLETIONS, {"prompt": text[:700], "add_special_tokens": False})]
    for now, (path, body) in enumerate(bodies):  # later chats extend earlier ones: the cache joins them
        answer = fast.tokenizer.tokens(body, path, float(now))
        assert answer.ids == slow.tokenizer.tokens(body, path, float(now)).ids
    assert fast.tokenizer.tokens(bodies[3][1], CHAT, 10.0).cached > 0


def test_a_word_level_tokenizer_loads_with_tokenizers(folder: Path, tmp_path: Path) -> None:
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    spec = {**spec_of(folder), "model": json.loads(words.to_str())["model"], "added_tokens": []}
    spec["pre_tokenizer"] = json.loads(pre_tokenizers.Whitespace().__getstate__())
    loaded = load_prompt_tokenizer(TokenizerSettings(str(variant(folder, tmp_path, spec)), **TIKTOKEN))
    assert loaded.encoder == "tokenizers"
    assert list(
        loaded.tokenizer.tokens({"prompt": "hello world", "add_special_tokens": False}, COMPLETIONS, 0.0).ids
    ) == [1, 2]
    spec["pre_tokenizer"] = spec_of(folder)["pre_tokenizer"]  # the BPE's shape but for the model
    (tmp_path / "variant" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert load_prompt_tokenizer(TokenizerSettings(str(tmp_path / "variant"), **TIKTOKEN)).why == (
        "tiktoken: the model is not a BPE"
    )


def test_merges_out_of_id_order_load_with_tokenizers(folder: Path, tmp_path: Path) -> None:
    spec = spec_of(folder)
    merges = spec["model"]["merges"]  # type: ignore[index]
    merges[10], merges[400] = merges[400], merges[10]
    loaded = load_prompt_tokenizer(TokenizerSettings(str(variant(folder, tmp_path, spec)), **TIKTOKEN))
    assert loaded.encoder == "tokenizers"
    assert "merges are not in id order" in loaded.why


def test_a_pre_tokenizer_without_a_split_regex_loads_with_tokenizers(folder: Path, tmp_path: Path) -> None:
    spec = spec_of(folder)
    spec["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    loaded = load_prompt_tokenizer(TokenizerSettings(str(variant(folder, tmp_path, spec)), **TIKTOKEN))
    assert loaded.encoder == "tokenizers"
    assert "not a Sequence" in loaded.why


def test_ids_that_differ_on_the_check_corpus_load_with_tokenizers(folder: Path, tmp_path: Path) -> None:
    """A merge rule dropped: its token stays in the vocabulary, tiktoken still makes it, tokenizers cannot."""
    spec = spec_of(folder)
    reference = TokenizersEncoder(Tokenizer.from_file(str(folder / "tokenizer.json")))
    made = set(reference.encode(" ".join(check_corpus([], [])[:40]), False))
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]  # type: ignore[index]
    dropped = max(i for i, (left, right) in enumerate(merges) if vocab[left + right] in made)
    del merges[dropped]
    loaded = load_prompt_tokenizer(TokenizerSettings(str(variant(folder, tmp_path, spec)), **TIKTOKEN))
    assert loaded.encoder == "tokenizers"
    assert "ids differ" in loaded.why


def test_the_check_compares_ids_with_and_without_special_tokens(folder: Path) -> None:
    class NoBos:
        """The folder's tokenizer, but adding no BOS (the check must compare add_special_tokens too)."""

        def __init__(self) -> None:
            self.inner = TokenizersEncoder(Tokenizer.from_file(str(folder / "tokenizer.json")))

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            ids = self.inner.encode(text, add_special_tokens)
            return ids[1:] if add_special_tokens and text != "probe" else ids

    with pytest.raises(NotRepresentable, match="ids differ"):
        tiktoken_encoder(spec_of(folder), NoBos(), ["a text"])


def test_special_tokens_in_text_and_lone_surrogates_match_tokenizers(folder: Path) -> None:
    spec = spec_of(folder)
    reference = TokenizersEncoder(Tokenizer.from_file(str(folder / "tokenizer.json")))
    fast = tiktoken_encoder(spec, reference, [])
    text = f"{SPECIAL_TOKENS[2]}user{SPECIAL_TOKENS[3]}\n\nhi{SPECIAL_TOKENS[4]}"
    assert fast.encode(text, True) == reference.encode(text, True)
    for encoder in (fast, reference):
        with pytest.raises(Exception):  # noqa: B017 (each library raises its own kind)
            encoder.encode("a \ud800 b", False)


def test_the_encoder_in_use_is_logged_and_in_the_metrics(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics(lambda: [])
    value = metrics.registry.get_sample_value
    caplog.set_level(logging.INFO, logger="ext_proc.tokenize.gateway")
    GatewayTokenizer.open(TokenizerSettings(str(folder), **TIKTOKEN), metrics).close()
    assert "encodes with tiktoken" in caplog.text
    assert [value("pd_extproc_tokenizer_encoder", {"encoder": e}) for e in ("tiktoken", "tokenizers")] == [
        1,
        0,
    ]
    GatewayTokenizer.open(TokenizerSettings(str(folder), fast_encoders=()), metrics).close()
    assert [value("pd_extproc_tokenizer_encoder", {"encoder": e}) for e in ("tiktoken", "tokenizers")] == [
        0,
        1,
    ]
    GatewayTokenizer.open(TokenizerSettings(str(tmp_path / "absent"), **TIKTOKEN), metrics).close()
    assert [value("pd_extproc_tokenizer_encoder", {"encoder": e}) for e in ("tiktoken", "tokenizers")] == [
        0,
        0,
    ]
