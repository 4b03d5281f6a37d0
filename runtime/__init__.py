"""GPU runtime: Triton kernels that read compressed weights (runtime/kernels/). The compressed
linear layers, pipelines and autotuner of the serving-layout issue build on them."""
