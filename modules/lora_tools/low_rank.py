"""The best rank-r approximation of a layer's update (Eckart–Young: its top singular values), as
a LoRA's (up, down): from the dense matrix (extract: a difference of two weights), or from a
LoRA's own factors (resize: W = up @ down of rank R, without forming W).

The factor path gives the dense path's result: with up = Q_u R_u and downᵀ = Q_d R_d (reduced
QR), W = Q_u (R_u R_dᵀ) Q_dᵀ, and Q_u, Q_d have orthonormal columns, so the singular values of
W are those of the small R×R core and its singular vectors are Q_u's and Q_d's images of the
core's. Its cost is a QR of each factor and one R×R SVD, instead of an SVD of the out × in
matrix (at SD 1.5 size, minutes for a whole LoRA on 2 CPU cores; seconds this way). Both work
in float64 and return float32 factors.
"""
from __future__ import annotations

import torch


def low_rank(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(up, down, share of the squared Frobenius norm kept) of the best rank-`rank`
    approximation of a 2-D matrix, by a dense SVD."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return _truncate(u, s, vh, rank)


def low_rank_of_factors(up: torch.Tensor, down: torch.Tensor, rank: int
                        ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`low_rank(up @ down, rank)` from the factors (out × R, R × in) without forming the
    product: a QR of each factor and an SVD of the R × R core."""
    q_up, r_up = torch.linalg.qr(up.double())
    q_down, r_down = torch.linalg.qr(down.double().T)
    u, s, vh = torch.linalg.svd(r_up @ r_down.T, full_matrices=False)
    return _truncate(q_up @ u, s, vh @ q_down.T, rank)


def _truncate(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int
              ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """up = U·√S, down = √S·Vᵀ of the top `rank` singular values; a matrix with fewer than
    `rank` of them (a layer narrower than the rank) gets zero columns / rows, so the factors
    always have `rank`."""
    total = float((s * s).sum())
    kept = float((s[:rank] * s[:rank]).sum())
    root = s[:rank].sqrt()
    up, down = u[:, :rank] * root, root[:, None] * vh[:rank]
    missing = rank - root.shape[0]
    if missing > 0:
        up = torch.cat([up, up.new_zeros(up.shape[0], missing)], dim=1)
        down = torch.cat([down, down.new_zeros(missing, down.shape[1])])
    return up.float(), down.float(), kept / total if total > 0 else 1.0
