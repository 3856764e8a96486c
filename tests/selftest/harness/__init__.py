"""Self-tests of the harness, how the suite runs a case: the plugin (options,
usage errors, stage gating, the stage table, known defects and their cures),
loading an implementation, the spawned pools and their zygote server, failing,
stuck and killed ranks, sessions that end leaving nothing, torchrun mode, GPU
placement and memory, xdist groups and file durations, the import graph."""
