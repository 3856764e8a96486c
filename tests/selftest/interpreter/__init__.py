"""Self-tests of dcpcheck's Triton interpreter patches
(``dcpcheck/triton_interpreter``): where they are installed, the language
shortcut, vectorised launches, and the port's kernels under the interpreter."""
