"""What computes sparse-MLA attention for the port: FlashInfer's SM120 entry as pinned, and the kernels behind it."""
