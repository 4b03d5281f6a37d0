"""What touches bits: the Triton kernels, each beside its launcher (imported lazily: triton loads only when one
is used), the CPU kernels (cpu_reference.py, the portable oracle; cpu_avx2.py; cpu_avx512.py; cpu_gemv.py, their
launchers), and the resident layouts they read (qtiles.py on CUDA; tile_tensors.py, the stored tiles on the CPU)."""
