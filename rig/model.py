"""A tiny Llama for real vLLM engines on a CPU: written by the tests, nothing downloaded.

:func:`write_tiny_llama` writes a Hugging Face model folder that vLLM loads with
``--load-format dummy`` (random weights: no weight file is read, so none is written): a
``LlamaForCausalLM`` config of hidden size 128 and head dim 64 (vLLM's CPU attention refuses a
smaller head dim), two layers, in :data:`DTYPE`, and a word-level tokenizer over :data:`WORDS`.
Text is nonsense; token counts are exact, which is what routing and KV-transfer tests need: a prompt
of ``n`` words from :func:`prompt` is ``n`` tokens (plus the beginning-of-sequence token vLLM adds).
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = tuple(f"w{i}" for i in range(1000))
"""The vocabulary's ordinary words (ids 3..1002; 0-2 are the special tokens)."""
SPECIAL = ("<unk>", "<s>", "</s>")
HIDDEN_SIZE = 128
HEAD_DIM = 64
LAYERS = 2
DTYPE = "float32"
"""The model's dtype, which vLLM's KV cache takes too: the config's ``torch_dtype`` and the engines'
``--dtype``. float32, not bfloat16: vLLM for CPU (0.32) runs its ``amx`` attention kernels when the CPU
has AMX tiles, the dtype is bfloat16 and the block size a multiple of 32
(``vllm/v1/attention/backends/cpu_attn.py`` ``_get_attn_isa``), and there a decode's worker dies of
SIGILL on its first step after a NixlConnector KV load (``Worker proc VllmWorker-0 died unexpectedly
(exit code: -4)``). In float32 every x86 CPU runs the ``vec`` kernels; the tiny model does not mind
the doubled KV bytes."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}[DTYPE]
"""Bytes of one element of :data:`DTYPE` (of a weight and of the KV cache)."""
KV_BYTES_PER_TOKEN = 2 * LAYERS * HIDDEN_SIZE * DTYPE_BYTES
"""KV-cache bytes one token takes: K and V of every layer (``HIDDEN_SIZE`` = KV heads x
``HEAD_DIM``), :data:`DTYPE_BYTES` each."""
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
"""Roles and contents joined by spaces: every word of a chat is one token (``user``, ``:`` and
``assistant`` are in the vocabulary too)."""
_CHAT_WORDS = ("user", "assistant", "system", ":")


def vocabulary() -> dict[str, int]:
    """Token → id: the special tokens, the chat template's words, then :data:`WORDS`."""
    tokens = [*SPECIAL, *_CHAT_WORDS, *WORDS]
    return {token: index for index, token in enumerate(tokens)}


def prompt(tokens: int, seed: int = 0) -> str:
    """A prompt of exactly ``tokens`` words (each one token), different for each ``seed``."""
    return " ".join(WORDS[(seed * 7919 + i * 31) % len(WORDS)] for i in range(tokens))


def write_tiny_llama(folder: Path) -> Path:
    """Write the model folder (config, generation config, tokenizer) into ``folder``; return it."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 2 * HIDDEN_SIZE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HIDDEN_SIZE // HEAD_DIM,
        "num_key_value_heads": HIDDEN_SIZE // HEAD_DIM,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": len(vocab),
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE,
    }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[token],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token in SPECIAL
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}},
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"]}
    for name, content in (
        ("config.json", config),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
        ("generation_config.json", generation),
    ):
        (folder / name).write_text(json.dumps(content, indent=1), encoding="utf-8")
    return folder
