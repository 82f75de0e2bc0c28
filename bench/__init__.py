"""The benchmarks: scripts that print tables and write JSON, never asserts on time.

Each runs from the root of a clone as ``python -m bench.<name>`` (``docs/benchmarks.md`` lists them, their
commands and their latest results); the modules without a command (``common``, ``fault_rig``,
``prefix_peers``, ``prefix_workloads``, ...) are the parts they share. They import ``ext_proc``, the
simulator (``sim``), the real-engine rig (``rig``) and the stand-ins (``standins``), never ``tests/``.
"""
