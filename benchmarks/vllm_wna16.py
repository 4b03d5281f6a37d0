"""vLLM-CPU's own W4A16 GEMM (`cpu_gemm_wna16`, through its CPUWNA16LinearKernel, as vLLM readies
a compressed-tensors layer for it) on the matrices int4_resident_bench.py times: run by that
benchmark (`--vllm`) in the vLLM environment (tests/envs.py), never beside another timing.

    python benchmarks/vllm_wna16.py EXPERTS ROUNDS ROWS... > times.json

Prints {rows: [ms an expert, one per round]} as JSON on its last line, BF16 x (the kernel takes no
FP32 activations).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
from int4_bench import GROUP, KIMI_EXPERT, quantize
from torch import nn

from unweight.runtime.kernels import int4


def layer_for(packed: np.ndarray, scales: np.ndarray, cols: int):
    """A module and the vLLM kernel readied for it, as vLLM's compressed-tensors WNA16 scheme does."""
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    rows = packed.shape[0]
    config = MPLinearLayerConfig(
        full_weight_shape=(cols, rows),
        partition_weight_shape=(cols, rows),
        weight_type=scalar_types.uint4b8,
        act_type=torch.bfloat16,
        group_size=GROUP,
        zero_points=False,
    )
    kernel = CPUWNA16LinearKernel(config, "weight_packed", "weight_scale", "weight_zero_point")
    m = nn.Module()
    m.weight_packed = nn.Parameter(torch.from_numpy(packed.copy()), requires_grad=False)
    m.weight_scale = nn.Parameter(torch.from_numpy(scales.copy()).view(torch.bfloat16), requires_grad=False)
    m.weight_packed.input_dim, m.weight_packed.output_dim, m.weight_packed.packed_dim = 1, 0, 1
    m.weight_scale.input_dim, m.weight_scale.output_dim = 1, 0
    m.weight_zero_point, m.bias = None, None
    kernel.process_weights_after_loading(m)
    return m, kernel


def main() -> None:
    try:
        experts, rounds, rows = int(sys.argv[1]), int(sys.argv[2]), [int(v) for v in sys.argv[3:]]
    except (IndexError, ValueError):
        usage = f"usage: {sys.argv[0]} EXPERTS ROUNDS ROWS... (int4_resident_bench.py --vllm runs it)"
        raise SystemExit(usage) from None
    if not rows:
        raise SystemExit("vllm_wna16.py: no ROWS given")
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    rng = np.random.default_rng(1)  # int4_resident_bench's matrices: experts(n, "gaussian", seed=1)
    mats = [(*quantize(rng, r, c, "gaussian"), c) for _ in range(experts) for r, c in KIMI_EXPERT]
    layers = [layer_for(p, s, c) for p, s, c in mats]
    p, s, c = mats[0]  # the kernel checked once against the plain product, within BF16's rounding of y
    w = (int4.unpack_nibbles(p, c).astype(np.float32) - 8) * np.repeat(
        (s.astype(np.uint32) << 16).view(np.float32), GROUP, 1
    )
    x = torch.randn(3, c).to(torch.bfloat16)
    want = x.float().numpy() @ w.T
    got = layers[0][1].apply_weights(layers[0][0], x).float().numpy()
    assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max(), np.abs(got - want).max()
    out = {}
    for m_rows in rows:
        xs = {c: torch.randn(m_rows, c).to(torch.bfloat16) for c in {c for _, _, c in mats}}
        run = [lambda m=m, k=k, c=c: k.apply_weights(m, xs[c]) for (m, k), (_, _, c) in zip(layers, mats)]
        [f() for f in run]
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            [f() for f in run]
            times.append((time.perf_counter() - t0) / experts * 1e3)
        out[m_rows] = times
    print(json.dumps(out))


if __name__ == "__main__":
    main()
