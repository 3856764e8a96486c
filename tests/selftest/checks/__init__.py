"""Self-tests of what a case checks and feeds: outputs compared by their
bits, the input check against hostile implementations, every mismatch
reported, a capability's wrong arity, the realistic tests' same-inputs check,
and the scenario builders (DSV4.1 topologies, vLLM's 16-bit combine sum)."""
