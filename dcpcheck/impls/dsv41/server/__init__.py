"""vLLM's server around the port's layer: the layer, a model-runner step, metadata, SWA pages, cache format, the DCP group."""
