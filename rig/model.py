"""A tiny Llama for real vLLM engines on a CPU: written by the tests, nothing downloaded.

:func:`write_tiny_llama` writes a Hugging Face model folder that vLLM loads with
``--load-format dummy`` (random weights: no weight file is read, so none is written): a
``LlamaForCausalLM`` config of hidden size 128 and head dim 64 (vLLM's CPU attention refuses a
smaller head dim), two layers, in :data:`DTYPE`, and a word-level tokenizer over :data:`WORDS`.
Text is nonsense; token counts are exact, which is what routing and KV-transfer tests need: a prompt
of ``n`` words from :func:`prompt` is ``n`` tokens (plus the beginning-of-sequence token vLLM adds).

:func:`write_lora_adapter` writes a LoRA adapter of that model (PEFT's folder layout: a rank
:data:`LORA_RANK` ``q_proj``/``v_proj`` adapter in ``adapter_config.json`` and
``adapter_model.safetensors``, written by hand), which vLLM serves with ``--enable-lora --lora-modules
NAME=FOLDER``.
"""

from __future__ import annotations

import json
import math
import struct
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
LORA_RANK = 8
"""The adapters' rank (the engines' ``--max-lora-rank``)."""
LORA_TARGETS = ("q_proj", "v_proj")
"""The attention projections the adapters change: both map ``HIDDEN_SIZE`` to ``HIDDEN_SIZE`` (as many
query as key-value heads)."""


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


def lora_folder(model: Path, name: str) -> Path:
    """Where the adapter ``name`` of the model folder ``model`` is written: beside it."""
    return model.parent / f"lora-{name}"


def _safetensors(tensors: dict[str, tuple[tuple[int, ...], list[float]]]) -> bytes:
    """``tensors`` (name → (shape, values in row-major order)) as a float32 safetensors file.

    The format: the JSON header's length (8 bytes, little-endian), the header (each tensor's dtype, shape
    and byte offsets into the data), then the data."""
    header: dict[str, object] = {}
    data = bytearray()
    for name, (shape, values) in tensors.items():
        assert len(values) == math.prod(shape), name
        start = len(data)
        data += struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, len(data)]}
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data)


def write_lora_adapter(folder: Path, base: Path, seed: int = 1) -> Path:
    """Write a LoRA adapter of the model in ``base`` into ``folder``; return it.

    Rank :data:`LORA_RANK` on :data:`LORA_TARGETS` of every layer, its weights small deterministic values
    from ``seed`` (``lora_A``: rank x in, ``lora_B``: out x rank, PEFT's names)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    tensors = {}
    for layer in range(LAYERS):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for matrix, shape in (("lora_A", (LORA_RANK, HIDDEN_SIZE)), ("lora_B", (HIDDEN_SIZE, LORA_RANK))):
                count = math.prod(shape)
                values = [((seed * 7919 + i * 31) % 201 - 100) / 10_000 for i in range(count)]
                tensors[f"{prefix}.{matrix}.weight"] = (shape, values)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (folder / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    return folder
