"""The vLLM plugin (`pip install 'unweight[vllm]'`): compressed checkpoints served by vLLM, with its
tensor and pipeline parallelism and scheduler. vLLM finds `register` through the
`vllm.general_plugins` entry point and calls it in each of its processes; nothing here imports
vLLM before that. docs/vllm.md says how to use it; runtime/vllm/plugin.py how it works."""


def register() -> None:
    """vllm.general_plugins entry point: the `unweight` quantization method and its loader, and the
    KV connector's short name (`"kv_connector": "UnweightConnector"`, no module path needed)."""
    import os

    # A vLLM-CPU worker runs OMP_NUM_THREADS OpenMP threads on the cores it binds (its main thread
    # bound to one of them). numba, imported next, would size its pool from that one core's
    # affinity, and its OpenMP layer, once started, sets the thread count the attention kernel then
    # runs with: 1 where the kernel's plan counted OMP_NUM_THREADS, and vLLM-CPU dies on the first
    # request ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)"). So numba gets
    # the worker's count, before it is first imported.
    if "OMP_NUM_THREADS" in os.environ:
        os.environ.setdefault("NUMBA_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from . import plugin  # registers UnweightConfig as it is imported

    plugin.register()
    if "UnweightConnector" not in KVConnectorFactory._registry:  # a second call in one process raises
        KVConnectorFactory.register_connector("UnweightConnector", f"{__name__}.kv_connector", "UnweightConnector")
