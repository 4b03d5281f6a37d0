"""The vLLM plugin (`pip install 'unweight[vllm]'`): compressed checkpoints served by vLLM, with its
tensor and pipeline parallelism and scheduler. vLLM finds `register` through the
`vllm.general_plugins` entry point and calls it in each of its processes; nothing here imports
vLLM before that. docs/vllm.md says how to use it; runtime/vllm/plugin.py how it works."""


def register() -> None:
    """vllm.general_plugins entry point: the `unweight` quantization method and its loader, and the
    KV connector's short name (`"kv_connector": "UnweightConnector"`, no module path needed)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from . import plugin  # registers UnweightConfig as it is imported

    plugin.register()
    if "UnweightConnector" not in KVConnectorFactory._registry:  # a second call in one process raises
        KVConnectorFactory.register_connector("UnweightConnector", f"{__name__}.kv_connector", "UnweightConnector")
