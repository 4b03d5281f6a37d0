"""Starts vLLM offline on each of several model folders that must be refused, in this one process,
and writes what each start did as JSON: what tests/test_vllm.py checks (one vLLM import for all of
them). It runs in the vLLM virtual environment, not the project's.

    python tests/vllm_refusals.py OUT.json FOLDER [FOLDER ...]

Each entry: {"folder", "started": bool, "error": the exception's text, "seconds": from the call to
its end, "load_seconds": in the plugin's loader (until it loaded or refused), "peak_rss_mb": this
process's peak resident set so far}. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so an error reaches here as raised, and the peak is the start's.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time


def main() -> None:
    out, folders = sys.argv[1], sys.argv[2:]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from unweight.runtime.vllm import plugin

    load = plugin.UnweightModelLoader.load_weights
    spent = []

    def timed(self, *args, **kwargs):  # the engine runs in this process: so does its loader
        t0 = time.perf_counter()
        try:
            return load(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    plugin.UnweightModelLoader.load_weights = timed
    results = []
    for folder in folders:
        spent.clear()
        t0 = time.perf_counter()
        entry = {"folder": folder, "started": False, "error": None}
        try:
            llm = LLM(
                model=folder, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, gpu_memory_utilization=0.1
            )
            entry["started"] = True
            del llm
        except Exception as e:  # noqa: BLE001 - whatever vLLM raised: the test reads its text
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["seconds"] = time.perf_counter() - t0
        entry["load_seconds"] = spent.pop() if spent else None
        entry["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.append(entry)
        gc.collect()
        print(json.dumps(entry)[:2000], flush=True)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
