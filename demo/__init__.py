"""The ``pd-extproc demo`` command (:mod:`demo.cli`): above the simulator and the real-engine rig."""
