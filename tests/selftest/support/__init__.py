"""What the self-tests share, none of it a test: inner pytest sessions and
the warm interpreter they are forked from (inner.py, session_probe.py,
session_sources.py), hostile rank functions and
implementations (hostile.py, rank_functions.py), process watching
(processes.py), the busy-machine slowdown (slowdown.py), scratch DCP2 trees
(scratch_trees.py), the interpreter's checks (interpreter_installation.py,
port_kernel_checks.py) and many tool calls in one process (tool_calls.py).
Self-tests of every folder import from here; nothing here imports a test."""
