"""The self-tests: the suite checking itself. By kind: harness/ (how a case runs),
checks/ (what a case compares and feeds), dsv41/ (the real DCP2 port of a vLLM
tree), interpreter/ (dcpcheck's Triton interpreter patches), tools/ (tools/);
support/ holds what they share, none of it a test."""
