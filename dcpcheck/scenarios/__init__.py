"""Deterministic batches and traces shared by the stages of the suite."""
