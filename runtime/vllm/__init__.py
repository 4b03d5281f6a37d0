"""The vLLM plugin (`pip install 'unweight[vllm]'`): compressed checkpoints served by vLLM, with its
tensor and pipeline parallelism and scheduler. vLLM finds `register` through the
`vllm.general_plugins` entry point and calls it in each of its processes; nothing here imports
vLLM before that. docs/vllm.md says how to use it; runtime/vllm/plugin.py how it works."""


def register() -> None:
    """vllm.general_plugins entry point: the `unweight` quantization method and its loader."""
    from . import plugin  # registers UnweightConfig as it is imported

    plugin.register()
