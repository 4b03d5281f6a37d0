"""What touches bits: the Triton kernels, each beside its launcher (imported lazily: triton loads only when one
is used), the CPU kernels (cpu_reference.py, the portable oracle; cpu_avx2.py; cpu_avx512.py and its passes,
cpu_avx512_*.py; cpu_gemv.py, their launchers), the typed weight values every launcher takes (weight.py) and the
resident layouts they hold (qtiles.py on CUDA; tile_tensors.py, the stored tiles on the CPU)."""
