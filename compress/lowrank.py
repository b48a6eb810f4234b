"""Low-rank factorization of Linear weights: W (m x n) ~ W_u (m x k) @ W_v (k x n), stored as two Linears.

rank k = floor(m * n * ratio / (m + n)): the two factors hold `ratio` of the original parameters.
- svd: truncated SVD of W (best rank-k in the Frobenius norm of W, blind to the inputs).
- svd-llm (Wang et al. 2024): whitening S = cholesky(X X^T) in fp64 (X: calibration inputs), SVD of W S =
  U Sigma V^T, W_u = U_k sqrt(Sigma_k), W_v = sqrt(Sigma_k) V_k^T S^-1: the truncation error is then the
  error on the calibration outputs, ||(W - W_u W_v) X||_F, minimised by construction.
- asvd (Yuan et al. 2023): input channels scaled by s_j = mean|x_j|^alpha (alpha 0.5), SVD of W diag(s),
  W_v = sqrt(Sigma_k) V_k^T diag(s)^-1.
The Linears of a decoder layer are factorized true-sequentially (later ones see the factorized earlier ones).
"""

from __future__ import annotations

import torch

from compress.gptq import Hessian, sequential_groups
from compress.layerjob import LayerJob
from memfit.errors import UserError

ASVD_ALPHA = 0.5


def rank_for(m: int, n: int, ratio: float) -> int:
    return int(m * n * ratio // (m + n))


def check_ratio(ratio: float, flag: str = "--ratio") -> None:
    if not 0 < ratio <= 1:
        raise UserError(f"{flag} must be in (0, 1] (fraction of the parameters kept), got {ratio:g}")


def check_ranks(shapes: dict[str, tuple[int, int]], ratio: float, flag: str = "--ratio") -> dict[str, int]:
    """Rank per module (shape = (out, in)); refuses a ratio that leaves any module with rank < 1."""
    check_ratio(ratio, flag)
    ranks = {n: rank_for(m, k, ratio) for n, (m, k) in shapes.items()}
    bad = [n for n, r in ranks.items() if r < 1]
    if bad:
        m, k = shapes[bad[0]]
        raise UserError(f"{flag} {ratio} gives rank {ranks[bad[0]]} < 1 for {bad[0]} ({m}x{k}): "
                        f"need ratio >= {(m + k) / (m * k):.4g}")
    return ranks


def _split(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = S[:k].sqrt()
    return U[:, :k] * r, r.unsqueeze(1) * Vh[:k]


def svd(w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
    wu, wv = _split(U, S, Vh, k)
    return wu.float(), wv.float()


def whitening(H: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor S of X X^T (fp64), with growing diagonal damping if it is singular."""
    H = H.double()
    eye = torch.eye(H.shape[0], dtype=torch.float64)
    damp = 0.0
    base = float(torch.diag(H).mean()) or 1.0
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if int(info) == 0:
            return L
        damp = base * (1e-8 if damp == 0 else damp / base * 100)
    raise RuntimeError("svd-llm: X X^T is not positive definite even with damping")


def svd_llm(w: torch.Tensor, H: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    S = whitening(H)
    U, sig, Vh = torch.linalg.svd(w.double() @ S, full_matrices=False)
    wu, wv = _split(U, sig, Vh, k)
    wv = torch.linalg.solve_triangular(S, wv, upper=False, left=False)  # wv @ S^-1
    return wu.float(), wv.float()


def asvd(w: torch.Tensor, mean_abs: torch.Tensor, k: int,
         alpha: float = ASVD_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    s = mean_abs.double().clamp(min=1e-6).pow(alpha)
    U, sig, Vh = torch.linalg.svd(w.double() * s, full_matrices=False)
    wu, wv = _split(U, sig, Vh, k)
    return wu.float(), (wv / s).float()


class Stats:
    """X X^T (gptq.Hessian, scale-free for whitening) and mean |x| per input channel."""

    def __init__(self, cols: int) -> None:
        self.h = Hessian(cols)
        self.abs_sum = torch.zeros(cols, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        self.h.add(x)
        x2 = x.reshape(-1, x.shape[-1])
        self.abs_sum += x2.double().abs().sum(0)
        self.n += x2.shape[0]


def factorize_layer(job: LayerJob) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(W_u, W_v) per Linear of job; each Linear's weight becomes W_u @ W_v for the layers after it."""
    method, ranks = job.options["method"], job.options["ranks"]
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if method == "svd":
        groups = [[n] for n in job.linears]
    else:
        groups = sequential_groups(job)
        groups += [[n] for n in job.linears if n not in {x for g in groups for x in g}]
    for group in groups:
        stats = {n: Stats(job.linears[n].in_features) for n in group}
        if method != "svd":
            job.run({n: stats[n].add for n in group}, stop_early=True)
        for n in group:
            mod, k = job.linears[n], ranks[job.prefix + n]
            w = mod.weight.data
            if method == "svd" or stats[n].n == 0:
                out[n] = svd(w, k)
            elif method == "svd-llm":
                out[n] = svd_llm(w, stats[n].h.H, k)
            else:
                out[n] = asvd(w, stats[n].abs_sum / stats[n].n, k)
            mod.weight.data = out[n][0] @ out[n][1]
    return out
