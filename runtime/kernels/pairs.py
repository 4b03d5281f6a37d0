"""The (token, expert) pairs of a grouped GEMV launch (qtiles_matmul.qtiles_experts_linear,
int4_matmul.int4_experts_linear): pair p multiplies row p // x_div of x by the expert ids[p]."""

from __future__ import annotations

import torch

MAX_PAIRS = 65535  # CUDA's limit on grid dimension 1, the pairs of one launch


def check_pairs(x: torch.Tensor, ids: torch.Tensor, x_div: int) -> None:
    """ValueError naming what of ids (1-D int32 or int64, x.shape[0] * x_div of them, on x's device)
    and x_div (an int in [1, MAX_PAIRS]) does not fit x."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32 or int64 tensor, not {ids.dtype} of shape {tuple(ids.shape)}")
    if not isinstance(x_div, int) or not 1 <= x_div <= MAX_PAIRS:
        raise ValueError(f"x_div must be an int in [1, {MAX_PAIRS}], not {x_div!r}")
    if ids.shape[0] != x.shape[0] * x_div:
        raise ValueError(f"{ids.shape[0]} ids for {x.shape[0]} rows of x with x_div {x_div}: need {x.shape[0] * x_div}")
    if ids.device != x.device:
        raise ValueError(f"ids are on {ids.device}, x on {x.device}")
