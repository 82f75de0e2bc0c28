"""A request's prompt in the engine's own token ids: the gateway tokenizer (``affinity.prefix.tokenizer``).

How it is used: docs/routing.md, "The gateway tokenizer".

- Pure (the pure-core import contract): :mod:`~ext_proc.tokenize.base` (the encoder protocol, the
  results, the failures), :mod:`~ext_proc.tokenize.template` (a chat rendered as vLLM renders it),
  :mod:`~ext_proc.tokenize.cache` (recent prefixes' token ids), :mod:`~ext_proc.tokenize.prompt` (a
  body's prompt in token ids, encoder given).
- Shell: :mod:`~ext_proc.tokenize.folder` (a tokenizer folder loaded, its encoder chosen),
  :mod:`~ext_proc.tokenize.fastokens_encoder` and :mod:`~ext_proc.tokenize.tiktoken_encoder` (the fast
  encoders), :mod:`~ext_proc.tokenize.check` (their check against ``tokenizers``),
  :mod:`~ext_proc.tokenize.gateway` (what the router awaits: tokenized off the event loop).

This module imports nothing: importing a pure module loads no tokenizer library.
"""
