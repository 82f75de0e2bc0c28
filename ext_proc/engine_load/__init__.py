"""The engine load signal: each engine's ``/metrics``, scraped and blended into the decision's load.

See docs/routing.md "Engine load signal".

- :mod:`~ext_proc.engine_load.names` maps metric names per engine type;
- :mod:`~ext_proc.engine_load.parse` turns a ``/metrics`` page into an engine sample;
- :mod:`~ext_proc.engine_load.blend` is the pure formula;
- :mod:`~ext_proc.engine_load.scraper` runs the scrapes and writes the result into the registry's load
  arrays (the affinity decision never knows where its numbers came from);
- :mod:`~ext_proc.engine_load.kinds` is the seam: the load-signal protocol and the table of its kinds.

This module imports nothing: the configuration (:mod:`~ext_proc.engine_load.config`) loads without the
HTTP client.
"""
