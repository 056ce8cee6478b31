"""Drop-in attention blocks for PyTorch models: projections, positions (RoPE where the
mechanism uses it), the mechanism's own options, and a KV cache for decoding, around
winnow's fused operators.

Each module maps (B, L, d_model) to (B, L, d_model), like the attention block of a GPT, and
is causal. ``implementation="composed"`` runs the same attention as the materialized PyTorch
expressions of :mod:`winnow.composed` instead (a check, and the baseline the kernels are
measured against). The modules compile with ``torch.compile(fullgraph=True)``.

    attn = winnow.nn.StickBreakingAttention(d_model=256, n_heads=4)
    y = attn(x)                                   # training or a whole prompt
    cache = winnow.nn.KVCache()
    y = attn(prompt, cache); y = attn(next_token, cache)   # incremental decoding
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Type

import torch
from torch import nn

import winnow
from winnow import composed

__all__ = ["KVCache", "Rope", "HeadNorm", "Attention", "SoftmaxAttention",
           "StickBreakingAttention", "EntmaxAttention", "SieveAttention", "MECHANISMS",
           "attention"]


def _fail(module: str, argument: str, expected: str, got) -> None:
    raise ValueError(f"{module}: argument '{argument}': expected {expected}, got {got!r}")


class KVCache:
    """The keys and values one attention module has seen, for incremental decoding: each call
    with a cache appends its new (B, T, H_kv, D) keys and values and attends over all of them
    (its queries are the last T positions). Use one cache per module and sequence batch.

    ``max_length`` preallocates room for that many positions (no copy per step); without it the
    cache grows by concatenation."""

    def __init__(self, max_length: Optional[int] = None) -> None:
        if max_length is not None and max_length < 1:
            _fail("KVCache", "max_length", "a positive length or None", max_length)
        self.max_length = max_length
        self.length = 0
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Adds k (B, T, H_kv, D) and v (B, T, H_kv, Dv); returns every key and value so far."""
        n = k.shape[1]
        if self._k is not None and (k.shape[0] != self._k.shape[0] or k.shape[2:] != self._k.shape[2:]
                                    or k.dtype != self._k.dtype or k.device != self._k.device):
            _fail("KVCache.append", "k",
                  f"batch, heads, head dimension, dtype and device of the cached keys "
                  f"{tuple(self._k.shape)} {self._k.dtype}", f"{tuple(k.shape)} {k.dtype}")
        if self.max_length is None:
            self._k = k if self._k is None else torch.cat([self._k, k], 1)
            self._v = v if self._v is None else torch.cat([self._v, v], 1)
        else:
            if self.length + n > self.max_length:
                _fail("KVCache.append", "k", f"at most {self.max_length - self.length} more "
                      f"positions (max_length {self.max_length})", n)
            if self._k is None:
                self._k = k.new_empty((k.shape[0], self.max_length) + tuple(k.shape[2:]))
                self._v = v.new_empty((v.shape[0], self.max_length) + tuple(v.shape[2:]))
            self._k[:, self.length:self.length + n] = k
            self._v[:, self.length:self.length + n] = v
        self.length += n
        return self._k[:, :self.length], self._v[:, :self.length]

    def reset(self) -> None:
        self.length = 0
        self._k = self._v = None


class Rope(nn.Module):
    """Rotary position embedding (spec/softmax.md) of (B, L, H, D) heads, by winnow's fused
    rotary kernel where it runs (CUDA; float32 / float64 on the CPU), with the extension
    scalings the seeds use:

    - ``"none"``;
    - ``"linear"``: positions divided by ``factor`` (position interpolation; 000 uses 16);
    - ``"ntk"``: the base raised to stretch low frequencies by about ``factor``;
    - ``"dynamic"``: NTK scaling by how far the sequence has grown past ``context_length``;
    - ``"yarn"``: low frequencies interpolated by ``factor``, high ones kept, a ramp between
      (``beta_fast``, ``beta_slow`` rotations over ``context_length``), and q and k each scaled
      by 0.1 ln(factor) + 1.
    """

    SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn")

    def __init__(self, head_dim: int, *, base: float = 10000.0, scaling: str = "none",
                 factor: float = 1.0, context_length: Optional[int] = None,
                 beta_fast: float = 32.0, beta_slow: float = 1.0) -> None:
        super().__init__()
        if head_dim % 2:
            _fail("Rope", "head_dim", "an even head dimension", head_dim)
        if scaling not in self.SCALINGS:
            _fail("Rope", "scaling", " | ".join(self.SCALINGS), scaling)
        if not factor >= 1:
            _fail("Rope", "factor", ">= 1", factor)
        if scaling in ("dynamic", "yarn") and not context_length:
            _fail("Rope", "context_length", f"the training context length for scaling '{scaling}'",
                  context_length)
        self.head_dim, self.base, self.scaling, self.factor = head_dim, base, scaling, factor
        self.context_length, self.beta_fast, self.beta_slow = context_length, beta_fast, beta_slow

    def tables(self, offset: int, length: int, seen: int,
               device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (length, D/2) for positions offset .. offset + length - 1, float64."""
        d = float(self.head_dim)
        f64 = dict(dtype=torch.float64, device=device)
        i = torch.arange(self.head_dim // 2, **f64)
        theta, positions = self.base, torch.arange(length, **f64) + offset
        attention_factor = 1.0
        if self.scaling == "ntk":
            theta = theta * self.factor ** (d / (d - 2))
        elif self.scaling == "dynamic" and seen > self.context_length:
            ratio = seen / self.context_length
            theta = theta * (self.factor * ratio - (self.factor - 1)) ** (d / (d - 2))
        inv_freq = theta ** (-2.0 * i / d)
        if self.scaling == "linear":
            positions = positions / self.factor
        elif self.scaling == "yarn" and self.factor > 1:
            def index_of(rotations: float) -> float:
                return d * math.log(self.context_length / (rotations * 2 * math.pi)) / (
                    2 * math.log(self.base))
            low = max(0.0, math.floor(index_of(self.beta_fast)))
            high = min(d / 2 - 1, math.ceil(index_of(self.beta_slow)))
            ramp = ((i - low) / max(high - low, 1e-3)).clamp(0, 1)
            inv_freq = inv_freq * (1 - ramp) + inv_freq / self.factor * ramp
            attention_factor = 0.1 * math.log(self.factor) + 1.0
        angles = positions[:, None] * inv_freq[None, :]
        return angles.cos() * attention_factor, angles.sin() * attention_factor

    def forward(self, x: torch.Tensor, offset: int = 0, seen: Optional[int] = None) -> torch.Tensor:
        """x (B, L, H, D) at positions offset .. offset + L - 1; ``seen``: the sequence length so
        far, for dynamic scaling (default offset + L)."""
        length = x.shape[1]
        seen = offset + length if seen is None else seen
        cos, sin = self.tables(offset, length, seen, x.device)
        table = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = cos.to(table), sin.to(table)
        if x.is_cuda or x.dtype in (torch.float32, torch.float64):
            return winnow.rotary_embedding(x, cos, sin)
        return composed.rotary_embedding(x, cos, sin)


class HeadNorm(nn.Module):
    """Head-wise normalization (002 appendix C): each head's output centred and scaled to unit
    root mean square over its Dv values, then a learned scale and shift per head."""

    def __init__(self, heads: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.bias = nn.Parameter(torch.zeros(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf - xf.mean(-1, keepdim=True)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias
        return y.to(x.dtype)


class Attention(nn.Module):
    """What every winnow attention module shares: q, k, v, o projections (grouped-query heads
    when ``n_kv_heads`` < ``n_heads``), positions, and the cache. Subclasses say how to attend.

    Args:
        d_model: width of the input and output.
        n_heads: query heads. ``n_kv_heads``: key/value heads, dividing n_heads (default: all).
        head_dim: query/key head width (default d_model / n_heads); ``value_dim`` the value
            head width (default head_dim).
        bias: biases in the projections.
        positions: ``"rope"`` or ``"nope"`` (default: the mechanism's own).
        rope: keyword arguments of :class:`Rope` (base, scaling, factor, context_length, ...).
        scale: the logit scale (default 1 / sqrt(head_dim)).
        implementation: ``"kernel"`` (winnow's fused operators) or ``"composed"``.
    """

    mechanism = ""
    default_positions = "nope"
    positions_allowed = ("rope", "nope")

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, value_dim: Optional[int] = None,
                 bias: bool = False, positions: Optional[str] = None,
                 rope: Optional[Dict] = None, scale: Optional[float] = None,
                 implementation: str = "kernel") -> None:
        super().__init__()
        name = type(self).__name__
        if d_model < 1:
            _fail(name, "d_model", "a positive width", d_model)
        if n_heads < 1:
            _fail(name, "n_heads", "a positive number of heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            _fail(name, "n_kv_heads", f"a divisor of n_heads ({n_heads})", n_kv_heads)
        if head_dim is None:
            if d_model % n_heads:
                _fail(name, "head_dim", f"given, since n_heads ({n_heads}) does not divide "
                      f"d_model ({d_model})", head_dim)
            head_dim = d_model // n_heads
        value_dim = head_dim if value_dim is None else value_dim
        positions = self.default_positions if positions is None else positions
        if positions not in self.positions_allowed:
            _fail(name, "positions", " | ".join(self.positions_allowed), positions)
        if implementation not in ("kernel", "composed"):
            _fail(name, "implementation", "\"kernel\" or \"composed\"", implementation)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim, self.value_dim = head_dim, value_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        self.implementation = implementation
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d_model, n_kv_heads * value_dim, bias=bias)
        self.o = nn.Linear(n_heads * value_dim, d_model, bias=bias)
        self.rope = Rope(head_dim, **(rope or {})) if positions == "rope" else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, Lq, H, D), (B, Lk, H_kv, D), (B, Lk, H_kv, Dv) -> (B, Lq, H, Dv)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """x (B, L, d_model) -> (B, L, d_model). With a cache, x holds the next L positions
        of the sequences the cache has seen."""
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.n_heads, self.head_dim)
        k = self.k(x).view(B, L, self.n_kv_heads, self.head_dim)
        v = self.v(x).view(B, L, self.n_kv_heads, self.value_dim)
        offset = cache.length if cache is not None else 0
        if self.rope is not None and self.rope.scaling == "dynamic":
            # The base depends on the length seen: keys are cached unrotated and all of them
            # turn with the current base.
            if cache is not None:
                k, v = cache.append(k, v)
            q = self.rope(q, offset, seen=offset + L)
            k = self.rope(k, 0, seen=offset + L)
        else:
            if self.rope is not None:
                q, k = self.rope(q, offset), self.rope(k, offset)
            if cache is not None:
                k, v = cache.append(k, v)
        o = self.attend(q, k, v)
        return self.o(o.reshape(B, L, self.n_heads * self.value_dim))

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, positions={'rope' if self.rope else 'nope'}, "
                f"implementation={self.implementation}")


class SoftmaxAttention(Attention):
    """Causal softmax attention (the baseline), RoPE by default. ``attend_current``: query j
    sees key j too (default True)."""

    mechanism = "softmax"
    default_positions = "rope"

    def __init__(self, d_model: int, n_heads: int, *, attend_current: bool = True, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.attend_current = attend_current

    def attend(self, q, k, v):
        if self.implementation == "composed":
            return composed.softmax_attention(q, k, v, scale=self.scale,
                                              attend_current=self.attend_current)
        return winnow.softmax_attention(q, k, v, scale=self.scale, attend_current=self.attend_current)


class _StickBreakingEpilogue(Attention):
    """Stick-breaking's options of 002 appendix C, shared with Sieve: remainder bias
    (o_j += rem_j r_h, r_h learned per head, starting at zero) and head-wise norm after it."""

    def __init__(self, d_model: int, n_heads: int, *, remainder_bias: bool = False,
                 head_norm: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.remainder_bias = (nn.Parameter(torch.zeros(self.n_heads, self.value_dim))
                               if remainder_bias else None)
        self.head_norm = HeadNorm(self.n_heads, self.value_dim) if head_norm else None

    def finish(self, out: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
        if self.remainder_bias is not None:
            out = out + rem.unsqueeze(-1).to(out.dtype) * self.remainder_bias.to(out.dtype)
        if self.head_norm is not None:
            out = self.head_norm(out)
        return out


class StickBreakingAttention(_StickBreakingEpilogue):
    """Causal stick-breaking attention (seed 002), no positions by default: the most recent
    keys take their share of the stick first. ``attend_current`` (default False: keys i < j),
    ``halt_cutoff`` (> 0: the kernel's early halting, exact over the keys it keeps),
    ``remainder_bias``, ``head_norm``."""

    mechanism = "stick_breaking"

    def __init__(self, d_model: int, n_heads: int, *, attend_current: bool = False,
                 halt_cutoff: float = 0.0, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if halt_cutoff < 0:
            _fail(type(self).__name__, "halt_cutoff", ">= 0 (0: off)", halt_cutoff)
        if halt_cutoff > 0 and self.implementation == "composed":
            _fail(type(self).__name__, "halt_cutoff",
                  "0 with implementation \"composed\" (only the kernel halts early)", halt_cutoff)
        self.attend_current, self.halt_cutoff = attend_current, halt_cutoff

    def attend(self, q, k, v):
        if self.implementation == "composed":
            out, rem = composed.stick_breaking_attention(q, k, v, scale=self.scale,
                                                         attend_current=self.attend_current)
        else:
            out, rem = winnow.stick_breaking_attention(q, k, v, scale=self.scale,
                                                       attend_current=self.attend_current,
                                                       halt_cutoff=self.halt_cutoff)
        return self.finish(out, rem)


class EntmaxAttention(Attention):
    """Causal alpha-entmax attention: exactly sparse rows (alpha > 1; 2 is sparsemax, 1.5 the
    default). RoPE by default; ``attend_current`` default True."""

    mechanism = "entmax"
    default_positions = "rope"

    def __init__(self, d_model: int, n_heads: int, *, alpha: float = 1.5,
                 attend_current: bool = True, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if not alpha > 1:
            _fail(type(self).__name__, "alpha", "> 1", alpha)
        self.alpha, self.attend_current = alpha, attend_current

    def attend(self, q, k, v):
        if self.implementation == "composed":
            return composed.entmax_attention(q, k, v, scale=self.scale,
                                             attend_current=self.attend_current, alpha=self.alpha)
        return winnow.entmax_attention(q, k, v, scale=self.scale,
                                       attend_current=self.attend_current, alpha=self.alpha)


class SieveAttention(_StickBreakingEpilogue):
    """Causal Sieve attention (seed 000): an alpha-entmax filter (``filter="exact"``) or its
    bound (``"bound"``: keys within ``eps`` of the row maximum), then stick-breaking over the
    candidates. No positions. ``alpha`` (default 1.5), ``attend_current`` (default False),
    ``remainder_bias``, ``head_norm``."""

    mechanism = "sieve"
    positions_allowed = ("nope",)

    def __init__(self, d_model: int, n_heads: int, *, alpha: float = 1.5, filter: str = "exact",
                 eps: Optional[float] = None, attend_current: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        name = type(self).__name__
        if not alpha > 1:
            _fail(name, "alpha", "> 1", alpha)
        if filter not in ("exact", "bound"):
            _fail(name, "filter", "\"exact\" or \"bound\"", filter)
        if eps is not None and (filter != "bound" or not eps > 0):
            _fail(name, "eps", "None, or > 0 with filter \"bound\"", eps)
        self.alpha, self.filter, self.eps, self.attend_current = alpha, filter, eps, attend_current

    def attend(self, q, k, v):
        fn = composed.sieve_attention if self.implementation == "composed" else winnow.sieve_attention
        out, rem, _ = fn(q, k, v, scale=self.scale, attend_current=self.attend_current,
                         alpha=self.alpha, filter=self.filter, eps=self.eps)
        return self.finish(out, rem)


MECHANISMS: Dict[str, Type[Attention]] = {
    cls.mechanism: cls
    for cls in (SoftmaxAttention, StickBreakingAttention, EntmaxAttention, SieveAttention)
}


def attention(mechanism: str, d_model: int, n_heads: int, **kwargs) -> Attention:
    """The attention module of a mechanism by name: ``"softmax"``, ``"stick_breaking"``,
    ``"entmax"`` or ``"sieve"``; keyword arguments as its class takes them."""
    if mechanism not in MECHANISMS:
        _fail("winnow.nn.attention", "mechanism", " | ".join(MECHANISMS), mechanism)
    return MECHANISMS[mechanism](d_model, n_heads, **kwargs)
