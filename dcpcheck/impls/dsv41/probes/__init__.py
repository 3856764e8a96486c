"""Questions asked of the tree once per session; their answers decide which findings the checks report."""
