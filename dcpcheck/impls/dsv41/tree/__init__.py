"""What is read and loaded from the vLLM tree under test: its port module, its source."""
