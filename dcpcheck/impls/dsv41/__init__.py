"""``--dcp-impl dsv41[:MODULE:CLASS]``: the DCP2 port of a vLLM tree's DeepSeek-V4.1 attention,
checked through its real class. The rooms: ``tree/`` (what is read and loaded from the tree),
``server/`` (vLLM's server around the layer), ``kernels/`` (what computes attention), ``stages/``
(stage capabilities on the port's fused calls), ``probes/`` (questions asked of the tree once),
``findings/`` (the port's known defects, their cures, the stand-ins manifest);
:mod:`.implementation` is the facade ``--dcp-impl`` loads."""
