"""The generation engines: torch's, and a NumPy one with compiled kernels, and what they tune by measuring."""
