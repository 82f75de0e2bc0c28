"""The prefix index: which prompt blocks each engine is estimated to hold.

How it routes: docs/routing.md, "Prefix-cache aware routing".

- What every kind shares: :mod:`~ext_proc.prefix.settings` (``affinity.prefix`` as values),
  :mod:`~ext_proc.prefix.lookup` (a request's lookup, its ``Placed`` record, the prediction sink),
  :mod:`~ext_proc.prefix.hits` (matched blocks as the decision's hit arrays), and
  :mod:`~ext_proc.prefix.kinds`, the seam (two calls a request: ``lookup_prompt``, ``placed``).
- ``approximate``: :mod:`~ext_proc.prefix.blocks` turns a prompt into chained block hashes,
  :mod:`~ext_proc.prefix.index` is the per-endpoint LRU index (its blocks in
  :mod:`~ext_proc.prefix.table`'s hash tables, as the ``kv-events`` kind's),
  :mod:`~ext_proc.prefix.correction` the pure self-correction rule from the engines' prefix-cache
  counters, :mod:`~ext_proc.prefix.tracker` the kind around them.
- ``kv-events`` (:mod:`~ext_proc.prefix.event_source`) reads the engines' KV-cache events instead:
  :mod:`~ext_proc.prefix.kv_events` decodes them, :mod:`~ext_proc.prefix.event_index` holds what each
  engine reported, :mod:`~ext_proc.prefix.recent` the placements of the last seconds.

The decision (:mod:`ext_proc.affinity`) reads only the hit arrays, as it reads only the load arrays.
This module imports nothing: the configuration (:mod:`~ext_proc.prefix.config`) loads without the
compiled index.
"""
