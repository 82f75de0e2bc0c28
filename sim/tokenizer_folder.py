"""A model's tokenizer folder made from local text: what tests and benchmarks tokenize with offline.

:func:`write_tokenizer_folder` trains a byte-level BPE shaped like Llama 3's (its pre-tokenizer
pattern, ``<|begin_of_text|>`` added in front of a prompt by the post-processor, the chat special
tokens) on the given texts and writes ``tokenizer.json`` and a ``tokenizer_config.json`` with a chat
template, as transformers saves a tokenizer. Nothing is downloaded; training on a few hundred kB of text
takes well under a second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenizer pattern: words, up to 3 digits, punctuation runs, newlines, spaces."""

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{%- if system_message %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ('user', 'assistant', 'tool') %}\n"
    "        {{- raise_exception('unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message.tool_calls is defined %}\n"
    "        {{- message.tool_calls | tojson }}\n"
    "    {%- endif %}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
"""A chat template in the manner of Llama 3's: system message first, a header and ``<|eot_id|>`` per turn."""


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens included) trained on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def write_tokenizer_folder(
    folder: Path, texts: Iterable[str], vocab_size: int, chat_template: str = LLAMA3_TEMPLATE
) -> Path:
    """Train a tokenizer on ``texts``, save it with ``chat_template`` to ``folder`` (made); ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, vocab_size).save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": {"content": "<|eot_id|>", "lstrip": False, "rstrip": False, "special": True},
        "chat_template": chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
