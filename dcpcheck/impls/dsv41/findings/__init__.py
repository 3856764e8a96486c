"""The port's known defects, the cures that neutralise them, and the manifest of stand-ins."""
