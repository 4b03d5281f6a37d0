"""The KV cache on the wire, shared by `unweight serve`'s KV link (runtime/serve/kv_link.py) and the
vLLM KV connector (runtime/vllm/kv_connector.py): frames coded losslessly in the cache's own dtype,
and sealed with a key of their transfer (wire.py). Nothing here imports the server or vLLM."""
