"""Self-tests of ``tools/``: the tree builder (``build_dsv41_tree.sh``) and
its safety, ``carry_vllm.py``, ``diff_coverage.py``, ``cpu_profile.py``, and
``gpu_ci.py``'s summary, session time-out and usage errors."""
