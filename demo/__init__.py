"""The ``pd-extproc demo`` command (:mod:`demo.cli`), above the two demos it runs.

The demos: :mod:`sim.demo` on simulated engines and :mod:`rig.demo` on real vLLM engines (which the simulator
never imports)."""
