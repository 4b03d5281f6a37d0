"""Triton kernels, each beside its launcher. Imported lazily: triton loads only when one is used."""
