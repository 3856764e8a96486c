"""Stage capabilities run on the port's own fused calls."""
