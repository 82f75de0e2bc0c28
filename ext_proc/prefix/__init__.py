"""The prefix index: which prompt blocks each engine is estimated to hold.

How it routes: docs/routing.md, "Prefix-cache aware routing".

- :mod:`~ext_proc.prefix.settings`: the settings every kind reads; :mod:`~ext_proc.prefix.kinds`: the
  seam (the prefix-source protocol and its kinds).
- ``approximate``: :mod:`~ext_proc.prefix.blocks` turns a prompt into chained block hashes,
  :mod:`~ext_proc.prefix.index` is the per-endpoint LRU index (its blocks in
  :mod:`~ext_proc.prefix.table`'s hash tables, as the ``kv-events`` kind's),
  :mod:`~ext_proc.prefix.correction` the pure self-correction rule from the engines' prefix-cache
  counters, :mod:`~ext_proc.prefix.tracker` what the router calls per request.
- ``kv-events`` (:mod:`~ext_proc.prefix.event_source`) reads the engines' KV-cache events instead:
  :mod:`~ext_proc.prefix.kv_events` decodes them, :mod:`~ext_proc.prefix.event_index` holds what each
  engine reported, :mod:`~ext_proc.prefix.recent` the placements of the last seconds.

The decision (:mod:`ext_proc.affinity`) reads only the hit arrays, as it reads only the load arrays.
This module imports nothing: the configuration (:mod:`~ext_proc.prefix.config`) loads without the
compiled index.
"""
