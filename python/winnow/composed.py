"""The same attention as winnow's operators, written as composed PyTorch expressions straight
from the spec: every (query, key) weight materialized, O(L^2) memory. They are the baselines
the fused operators are measured against and a check of them; `winnow.nn` modules run them
with ``implementation="composed"``.

Shapes and options as in the operators: q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv)
with Lq <= Lk (the queries are the last Lq positions) and Hq a multiple of Hkv; ``scale``
defaults to 1 / sqrt(D). No varlen (packed) inputs.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["softmax_attention", "stick_breaking_attention", "entmax_attention",
           "sieve_attention", "screening_attention", "rotary_embedding", "entmax_threshold"]


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(B, H, L, D) views with the kv heads repeated for their query heads."""
    group = q.shape[2] // k.shape[2]
    kh = k.transpose(1, 2)
    vh = v.transpose(1, 2)
    if group > 1:
        kh = kh.repeat_interleave(group, 1)
        vh = vh.repeat_interleave(group, 1)
    return q.transpose(1, 2), kh, vh


def _visible(lq: int, lk: int, attend_current: bool, device) -> torch.Tensor:
    """(Lq, Lk): key i is visible to query j (at position Lk - Lq + j) when i < j, or i <= j."""
    pos_q = torch.arange(lq, device=device) + (lk - lq)
    pos_k = torch.arange(lk, device=device)
    if attend_current:
        return pos_k[None, :] <= pos_q[:, None]
    return pos_k[None, :] < pos_q[:, None]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scores(q, k, scale):
    qh, kh, _ = _heads(q, k, k)
    d = q.shape[-1]
    s = (1.0 / math.sqrt(d)) if scale is None else scale
    return (qh @ kh.transpose(-1, -2)).to(_work_dtype(q)) * s


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), exact for every x (torch's softplus is linear above its threshold)."""
    return torch.logaddexp(x, torch.zeros_like(x))


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: Optional[float] = None, attend_current: bool = True) -> torch.Tensor:
    """softmax(z) over the visible keys; a row with none outputs zero. Returns (B, Lq, Hq, Dv)."""
    z = _scores(q, k, scale)
    visible = _visible(q.shape[1], k.shape[1], attend_current, q.device)
    z = z.masked_fill(~visible, float("-inf"))
    w = torch.softmax(z, -1).nan_to_num(0.0)  # rows without a visible key
    _, _, vh = _heads(q, k, v)
    return (w.to(v.dtype) @ vh).transpose(1, 2)


def stick_breaking_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             scale: Optional[float] = None,
                             attend_current: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stick-breaking (spec/stick-breaking.md): log A_ij = z_ij - sum_{k >= i visible}
    softplus(z_kj), the sum a reverse cumulative sum from the query back. Returns (out, rem),
    rem = exp(-sum_i softplus(z_ij)) the stick left unallocated."""
    z = _scores(q, k, scale)
    visible = _visible(q.shape[1], k.shape[1], attend_current, q.device)
    # Hidden logits are zeroed before softplus and exp, so no inf reaches their gradient.
    zm = z.masked_fill(~visible, 0.0)
    cost = _softplus(zm).masked_fill(~visible, 0.0)
    suffix = cost.flip(-1).cumsum(-1).flip(-1)
    w = torch.exp(zm - suffix).masked_fill(~visible, 0.0)
    _, _, vh = _heads(q, k, v)
    out = (w.to(v.dtype) @ vh).transpose(1, 2)
    rem = torch.exp(-cost.sum(-1)).transpose(1, 2).to(q.dtype)
    return out, rem


def entmax_threshold(x: torch.Tensor, alpha: float, visible: torch.Tensor,
                     iterations: int = 100) -> torch.Tensor:
    """tau per row with sum_i max(x_i - tau, 0)^(1 / (alpha - 1)) = 1 over the visible keys, by
    bisection on [max - 1, max] (no gradient). Returns (..., 1)."""
    with torch.no_grad():
        xd = x.to(torch.float64).masked_fill(~visible, float("-inf"))
        hi = xd.max(-1, keepdim=True).values
        hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
        lo = hi - 1
        for _ in range(iterations):
            mid = (lo + hi) / 2
            f = torch.clamp(xd - mid, min=0).pow(1 / (alpha - 1)).sum(-1, keepdim=True)
            lo, hi = torch.where(f >= 1, mid, lo), torch.where(f >= 1, hi, mid)
        return lo.to(x.dtype)


def _entmax_weights(x: torch.Tensor, alpha: float, visible: torch.Tensor) -> torch.Tensor:
    """p = (x - tau)_+^(1 / (alpha - 1)) with tau the row threshold, differentiable: tau is
    found without gradient, then enters as tau0 + sum_i (g_i / G)(x_i - x_i.detach()) with
    g_i = (x_i - tau0)_+^((2 - alpha) / (alpha - 1)), the implicit-function gradient
    dtau/dx_i = g_i / sum g (its value stays tau0)."""
    tau0 = entmax_threshold(x, alpha, visible)
    support = visible & (x.detach() > tau0)
    gap = (x.detach() - tau0).clamp(min=0)
    g = torch.where(support, gap.pow((2 - alpha) / (alpha - 1)), torch.zeros_like(gap))
    share = g / g.sum(-1, keepdim=True).clamp(min=torch.finfo(g.dtype).tiny)
    tau = tau0 + (share * (x - x.detach())).sum(-1, keepdim=True)
    return torch.where(support, torch.clamp(x - tau, min=0).pow(1 / (alpha - 1)), torch.zeros_like(x))


def entmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     scale: Optional[float] = None, attend_current: bool = True,
                     alpha: float = 1.5) -> torch.Tensor:
    """alpha-entmax (spec/entmax.md): p_ij = ((alpha - 1) z_ij - tau_j)_+^(1 / (alpha - 1)),
    each row summing to one. Returns (B, Lq, Hq, Dv)."""
    x = (alpha - 1) * _scores(q, k, scale)
    visible = _visible(q.shape[1], k.shape[1], attend_current, q.device)
    w = _entmax_weights(x, alpha, visible)
    _, _, vh = _heads(q, k, v)
    return (w.to(v.dtype) @ vh).transpose(1, 2)


def sieve_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    scale: Optional[float] = None, attend_current: bool = False,
                    alpha: float = 1.5, filter: str = "exact",
                    eps: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sieve (spec/sieve.md): stick-breaking over each row's candidates, the keys whose score
    is above the alpha-entmax threshold (``exact``) or within ``eps`` (default 1 / (alpha - 1))
    of the row maximum (``bound``). The filter passes no gradient. Returns (out, rem, count)."""
    z = _scores(q, k, scale)
    visible = _visible(q.shape[1], k.shape[1], attend_current, q.device)
    with torch.no_grad():
        if filter == "exact":
            threshold = entmax_threshold((alpha - 1) * z, alpha, visible) / (alpha - 1)
        elif filter == "bound":
            width = 1 / (alpha - 1) if eps is None else eps
            threshold = z.masked_fill(~visible, float("-inf")).max(-1, keepdim=True).values - width
        else:
            raise ValueError(f"sieve_attention: argument 'filter': expected \"exact\" or "
                             f"\"bound\", got \"{filter}\"")
        kept = visible & (z > threshold)
    zm = z.masked_fill(~kept, 0.0)
    cost = _softplus(zm).masked_fill(~kept, 0.0)
    suffix = cost.flip(-1).cumsum(-1).flip(-1)
    w = torch.exp(zm - suffix).masked_fill(~kept, 0.0)
    _, _, vh = _heads(q, k, v)
    out = (w.to(v.dtype) @ vh).transpose(1, 2)
    rem = torch.exp(-cost.sum(-1)).transpose(1, 2).to(q.dtype)
    return out, rem, kept.sum(-1).transpose(1, 2).to(torch.int32)


def screening_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_w: torch.Tensor,
                        s_r: torch.Tensor, *, mipe_threshold: float = 256.0,
                        expand_windows_above: float = 0.0, norm_eps: float = 1e-6) -> torch.Tensor:
    """Multiscreen's screening unit (spec/screening.md): normalized q, k, v; MiPE on coordinates
    0 and 1 by absolute position; Trim; the causal Softmask; unnormalized sum; TanhNorm.
    ``s_w`` and ``s_r`` are (Hq) or (1); autograd gives every gradient."""
    heads = q.shape[2]
    s_w = s_w.expand(heads) if s_w.numel() == 1 else s_w
    s_r = s_r.expand(heads) if s_r.numel() == 1 else s_r
    w = torch.exp(s_w) + 1
    r = torch.sigmoid(s_r)
    infinite = (w > expand_windows_above) if expand_windows_above > 0 else torch.zeros_like(w, dtype=torch.bool)
    w_th = mipe_threshold
    gamma = torch.where(w < w_th, 0.5 * (torch.cos(math.pi * w / w_th) + 1), torch.zeros_like(w))
    rate = torch.where(infinite, torch.zeros_like(w), math.pi * gamma / w)  # (H)

    def unit(x):
        return x / x.norm(dim=-1, keepdim=True).clamp_min(norm_eps)

    qh, kh, vh = _heads(unit(q), unit(k), unit(v))  # (B, H, L, D)
    lq, lk = q.shape[1], k.shape[1]
    pos_q = torch.arange(lq, device=q.device, dtype=q.dtype) + (lk - lq)
    pos_k = torch.arange(lk, device=q.device, dtype=q.dtype)

    def mipe(x, pos):
        angle = rate.to(x.dtype)[:, None] * pos[None, :]  # (H, L)
        c, s = torch.cos(angle), torch.sin(angle)
        x0, x1 = x[..., 0], x[..., 1]
        return torch.cat([(x0 * c - x1 * s)[..., None], (x0 * s + x1 * c)[..., None], x[..., 2:]], -1)

    scores = mipe(qh, pos_q) @ mipe(kh, pos_k).transpose(-1, -2)  # (B, H, Lq, Lk)
    alpha = torch.relu(1 - (1 - scores) / r.to(q.dtype)[:, None, None]) ** 2
    d = pos_k[None, :] - pos_q[:, None]  # j - i
    wq = w.to(q.dtype)[:, None, None]
    inside = (d[None] <= 0) & ((d[None] > -wq) | infinite[:, None, None])
    mask = torch.where(infinite[:, None, None], torch.ones_like(wq), 0.5 * (torch.cos(math.pi * d[None] / wq) + 1))
    rel = torch.where(inside, alpha * mask, torch.zeros_like(alpha))
    h = rel @ vh
    n = h.norm(dim=-1, keepdim=True)
    factor = torch.where(n > 1e-4, torch.tanh(n) / n.clamp_min(1e-4), 1 - n * n / 3)
    return (h * factor).transpose(1, 2)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     transpose: bool = False) -> torch.Tensor:
    """The rotation of :func:`winnow.rotary_embedding`: pairs (i, i + D/2) of x (B, L, H, D)
    turn by the angles of tables cos, sin (L, D/2); ``transpose`` turns them back."""
    half = x.shape[-1] // 2
    work = _work_dtype(x)
    c = cos.to(work)[None, :, None, :]
    s = sin.to(work)[None, :, None, :]
    if transpose:
        s = -s
    low, high = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat([low * c - high * s, high * c + low * s], -1).to(x.dtype)
