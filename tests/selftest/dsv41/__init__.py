"""Self-tests of ``--dcp-impl dsv41``, the real DCP2 port of a vLLM tree: its
stand-ins, the FlashInfer and FlashMLA kernels' adapters, the fp8_ds_mla cache
format, the probes, and bugs planted in scratch trees of the seed port that the
dsv41 tests must catch (most need vLLM, several the built seed tree)."""
