"""The runtime's own Llama family: config (config.py), rope, the KV cache, the model (llama.py), sampling,
and the loader that fills it from a compressed folder (loader.py). Built on the layers (../layers/)."""
