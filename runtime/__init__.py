"""The runtime, in three rooms and what is built on them:

    kernels/  what touches bits: Triton kernels and launchers, the CPU kernels, the resident layouts
    layers/   nn.Modules over compressed weights: UnweightLinear, UnweightExperts, the autotuner
    model/    the Llama family, its config, rope, KV cache, sampling and loader

and on top: generate.py (text generation), threads.py (CPU threads), serve/ (the server), vllm/ (the
vLLM plugin), transformers/ (the transformers quantizer). Arrows point down only (tests/test_layers.py).
"""
