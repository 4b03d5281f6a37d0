"""benchmarks/vllm_disagg_bench.py end to end at its --quick sizes, on the aggregated and the unweight
set-ups only (each start of a `vllm serve` engine takes a minute or more here): its JSON holds, for both,
a TTFT and the decode host's received bytes at each link rate and a goodput summary at its rate, and for
unweight the side channel's bytes of a sealed pull of the whole prompt, coded as the prefill ran.
Figures are not judged: the cores are shared. Needs root (network namespaces), as CI runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envs import vllm_env

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_disagg_bench.py"


def test_quick_run_of_aggregated_and_unweight(smollm2_uw, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--setups", "agg,unweight", "--model-dir", str(smollm2_uw[0])]
    cmd += ["--vllm-python", str(vllm_env()), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "| set-up | link | TTFT ms |" in r.stdout and record["cpu"] in r.stdout  # the table, with its CPU
    assert [(x["setup"], "error" in x) for x in record["runs"]] == [("agg", False), ("unweight", False)], r.stdout
    per_token = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x kv heads x head dim x BF16
    for run in record["runs"]:
        assert [x["link"] for x in run["ttft"]] == ["1gbit", "10gbit"]
        for x in run["ttft"]:
            assert 0 < x["ttft"] <= x["e2e"] and x["prompt_tokens"] == 300 and x["tokens"] == 4
            assert x["raw_kv_bytes"] == 300 * per_token and x["decode_rx_bytes"] > 0
            if run["setup"] == "unweight":  # the KV crossed the decode host's link, and the side channel said so
                assert x["pulled_tokens"] == 300 and 0 < x["connector_bytes"] <= x["decode_rx_bytes"]
                assert x["staged_coding_s"] > 0  # the prefill engine coded the prompt as its forward ran
            else:  # only the request (its 300 token ids as JSON) and the acknowledgements
                assert x["connector_bytes"] is None and x["decode_rx_bytes"] < x["raw_kv_bytes"]
        (cell,) = run["goodput"].values()
        assert cell["requests"] > 0 and 0 <= cell["good"] <= cell["requests"] and cell["errors"] == 0, cell
    for setup in ("agg", "unweight"):
        s = record["summary"][setup]
        assert s["failed"] == 0 and s["link 1gbit"]["ttft"][0] > 0 and s["rate 0.5"]["requests"] > 0
