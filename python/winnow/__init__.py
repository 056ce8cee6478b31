"""winnow: causal attention that selects instead of spreading.

This package loads winnow's LibTorch operator library and exposes its operators as plain
functions. The operators themselves live in ``torch.ops.winnow`` once loaded, so C++ and
Python callers share one implementation and one autograd definition.

The library is found, in order, at ``$WINNOW_LIBRARY``, where ``pip install`` put it (inside
this package, ``winnow/lib/libwinnow_torch.so``; also for an editable install), or in the
repository's ``build/`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

import torch

# The project's version (CMakeLists.txt's project(VERSION), checked by the tests).
__version__ = "0.1.0"

__all__ = [
    "__version__",
    "library_path",
    "softmax_attention",
    "stick_breaking_attention",
    "entmax_attention",
    "sieve_attention",
    "threshold_attention",
    "screening_attention",
    "gsa_select_keys",
    "gsa_sparse_attention",
    "gsa_indexer_loss",
    "paged_decode",
    "rotary_embedding",
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "composed",
    "nn",
]

try:  # written by the build behind `pip install` (cmake/build_info.py.in)
    from . import _build_info
except ImportError:  # a source tree: the library comes from build/ or $WINNOW_LIBRARY
    _build_info = None


def _candidates():
    env = os.environ.get("WINNOW_LIBRARY")
    if env:
        yield Path(env)
    if _build_info is not None:
        yield _build_info.LIBRARY_DIR / "libwinnow_torch.so"
    here = Path(__file__).resolve().parent
    yield here / "lib" / "libwinnow_torch.so"
    yield here.parent.parent / "build" / "libwinnow_torch.so"


def _check_torch_abi(path: Path) -> None:
    """An installed library was compiled against one torch; another one's C++ ABI differs,
    and loading would fail obscurely or crash later."""
    if _build_info is None or path.parent != _build_info.LIBRARY_DIR:
        return
    built = _build_info.TORCH_VERSION.split(".")[:2]
    running = torch.__version__.split("+")[0].split(".")[:2]
    if built != running:
        raise ImportError(
            f"winnow: this installation was built against torch {_build_info.TORCH_VERSION}, "
            f"but torch {torch.__version__} is imported; reinstall winnow with this torch "
            "(pip install --no-build-isolation .)")


def _load() -> Path:
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            _check_torch_abi(path)
            torch.ops.load_library(str(path))
            return path
    raise ImportError(
        "winnow: the operator library libwinnow_torch.so was not found; build it "
        "(`make build`), install the package (`pip install .`) or set WINNOW_LIBRARY. "
        "Looked at: " + ", ".join(tried)
    )


library_path: Path = _load()


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    attend_current: bool = True,
    rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Causal softmax attention, differentiable in q, k and v.

    Shapes: q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) with Lq <= Lk (the
    queries are the last Lq positions) and Hq a multiple of Hkv (grouped-query attention);
    or packed (T, H, D) tensors with ``cu_seqlens_q`` (int32, B + 1 offsets) and optionally
    ``cu_seqlens_k``. Any strides. ``scale`` defaults to 1 / sqrt(D). Returns out
    (B, Lq, Hq, Dv); a query that sees no key outputs zero.

    ``rotary=(cos, sin)``: rotary embedding inside the operator, the same as rotating q and k
    with :func:`rotary_embedding` first. The tables are (Lk, D/2) as that function takes them;
    the keys sit at positions 0 .. Lk - 1 and the queries at the last Lq. Not with
    ``cu_seqlens``. When q and k are heads of one tensor (``qkv.split``), one launch rotates
    both, and when q, k and v are, their gradients come back as views of one tensor.
    """
    cos, sin = rotary if rotary is not None else (None, None)
    return torch.ops.winnow.softmax_attention(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scale=scale,
        attend_current=attend_current, rotary_cos=cos, rotary_sin=sin)


def stick_breaking_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    attend_current: bool = False,
    halt_cutoff: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal stick-breaking attention (Tan et al., seed 002), differentiable in q, k, v.

    Each visible key, from the most recent backwards, takes a sigmoid(z) share of the stick
    that is left: A_ij = sigmoid(z_ij) prod_{i < k < j} (1 - sigmoid(z_kj)), o_j = sum_i A_ij v_i.
    By default query j sees keys i < j (the paper's choice); ``attend_current=True`` adds
    key j. Shapes and ``scale`` as in :func:`softmax_attention`.

    ``halt_cutoff`` > 0 enables early halting: key tiles further left are skipped once every
    row of a query tile has less than exp(-halt_cutoff) of its stick left (results are then
    exact stick-breaking over the keys kept). 0 (default) disables it.

    Returns ``(out, rem)``: out (B, Lq, Hq, Dv) and rem (B, Lq, Hq), the stick left
    unallocated, 1 - sum_i A_ij; both are differentiable (the remainder-bias option of the
    paper adds rem * r to out).
    """
    return torch.ops.winnow.stick_breaking_attention(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scale=scale,
        attend_current=attend_current, halt_cutoff=halt_cutoff)


def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    attend_current: bool = True,
    alpha: float = 1.5,
) -> torch.Tensor:
    """Causal alpha-entmax attention (Peters et al.; the baseline of seeds 000 and 004).

    p_ij = [(alpha - 1) z_ij - tau_j]_+ ** (1 / (alpha - 1)) with tau_j chosen so that each
    row sums to one: keys far below the row's best score get exactly zero weight. ``alpha``
    > 1: 2 is sparsemax, 1.5 (default) the seeds' choice. Shapes and ``scale`` as in
    :func:`softmax_attention`; differentiable in q, k and v. Returns out (B, Lq, Hq, Dv).

    On CUDA, when gradients are wanted, the forward also lists each row's support keys for the
    backward (516 bytes per query row and head, held until the backward runs), which spares the
    backward a sweep over every key; ``WINNOW_ENTMAX_KEEP_SUPPORT=0`` in the environment turns
    that off. While it runs, the fused CUDA forward's threshold search borrows 1 KB per query
    row and head (at most 512 MB; past that, 256 bytes, at most 256 MB) for its candidate lists.
    """
    return torch.ops.winnow.entmax_attention(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scale=scale,
        attend_current=attend_current, alpha=alpha)


def threshold_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    lam: Optional[torch.Tensor] = None,
    q2: Optional[torch.Tensor] = None,
    k2: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    power: float = 2.0,
    attend_current: bool = True,
    clamp_lambda: bool = True,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Causal threshold attention (seed 004): TRA, or TDA when ``lam`` is given.

    Queries and keys are L2-normalized inside the operator; with cosine scores s_ij, row j
    keeps relu(s_ij - tau_j) ** power with tau_j = beta * sqrt(2 log(n_j) / D), n_j the keys it
    sees, and o_j = sum_i w_ij v_i (unnormalized weights, exact zeros below the threshold).
    TDA subtracts a second view: o = TRA(q, k, v) - lam * TRA(q2, k2, v), lam clamped to
    [0, 1] unless ``clamp_lambda`` is False. ``beta`` and ``lam`` are (Hq) or (1) tensors
    (float32, float64 for float64 inputs); everything but the offsets is differentiable. ReLA
    is beta = 0 with power 1. Shapes as in :func:`softmax_attention`.

    Memory: on CUDA, when gradients are wanted, the forward keeps its normalized queries and
    keys (per view as much as q and k) until the backward, which then need not normalize them
    again; ``WINNOW_THRESHOLD_KEEP_ROWS=0`` in the environment trades that time for the memory.
    """
    return torch.ops.winnow.threshold_attention(
        q, k, v, beta, lam=lam, q2=q2, k2=k2, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, power=power, attend_current=attend_current,
        clamp_lambda=clamp_lambda, norm_eps=norm_eps)


def screening_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s_w: torch.Tensor,
    s_r: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    mipe_threshold: float = 256.0,
    expand_windows_above: float = 0.0,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Multiscreen's screening unit (seed 001), causal.

    q, k, v are unit-normalized inside; MiPE rotates the first two coordinates of queries and
    keys by position * pi * gamma(w) / w (identity once w >= ``mipe_threshold``); query i keeps
    key j only inside its window (i - w < j <= i) and where the cosine clears 1 - r, with
    relevance max(1 - (1 - s) / r, 0) ** 2 * (cos(pi (j - i) / w) + 1) / 2; the relevant values
    are summed without normalization and squashed by TanhNorm. w = exp(s_w) + 1 and
    r = sigmoid(s_r), with ``s_w``, ``s_r`` (Hq) or (1) tensors (float32, float64 for float64
    inputs). ``expand_windows_above`` > 0 makes wider windows infinite (screening-window
    expansion). Differentiable in q, k, v, s_w and s_r. Shapes as in :func:`softmax_attention`
    (k's head dimension may differ from v's).
    """
    return torch.ops.winnow.screening_attention(
        q, k, v, s_w, s_r, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        mipe_threshold=mipe_threshold, expand_windows_above=expand_windows_above,
        norm_eps=norm_eps)


def sieve_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    attend_current: bool = False,
    alpha: float = 1.5,
    filter: str = "exact",
    eps: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal Sieve attention (seed 000): an alpha-entmax filter, then stick-breaking.

    Each row's candidate keys S_j are chosen first: with ``filter="exact"`` the support of
    alpha-entmax over the row's scores, with ``filter="bound"`` the keys whose score is within
    ``eps`` (default 1 / (alpha - 1)) of the row maximum, a superset of the exact support
    that needs only the maximum. Stick-breaking then allocates the row over S_j alone, most
    recent candidate first, so a far key above the threshold beats a closer one below it.
    Keys i < j by default, as in stick-breaking. Shapes and ``scale`` as in
    :func:`softmax_attention`.

    Returns ``(out, rem, count)``: out (B, Lq, Hq, Dv), rem (B, Lq, Hq) the stick left over
    the candidates (both differentiable in q, k, v; the filter passes no gradient), and count
    (int32, B, Lq, Hq) the number of candidates of each row. The exact filter's threshold
    search borrows scratch memory on CUDA while the forward runs, as :func:`entmax_attention`'s.
    """
    return torch.ops.winnow.sieve_attention(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scale=scale,
        attend_current=attend_current, alpha=alpha, filter=filter, eps=eps)


def gsa_select_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    head_weights: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    k_max: int,
    budget: str = "inverse_variance",
    k_base: int = 0,
    k_min: int = 1,
    k_fixed: Optional[int] = None,
    mean_variance: float = 1.0,
    form: str = "sigmoid",
    scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated Sparse Attention's indexer with exact top-k selection (seed 003, spec/gsa.md).

    Query t scores every key s <= t over the H_I indexer heads j:
    ``I_ts = sum_j sigmoid(w_tj) * sigmoid(<q_tj, k_s> * scale + b_j)`` (``form="sigmoid"``,
    GSA's) or ``sum_j w_tj * relu(<q_tj, k_s> * scale)`` (``form="relu"``, DeepSeek-V3.2's; no
    bias), takes the population variance Var_t of its row, turns it into a budget k_t and
    keeps the k_t best keys (all of them when t + 1 <= k_t; ties toward the more recent key).
    Nothing of size L x L is materialized.

    Shapes: q (B, Lq, H_I, d_I) and k (B, Lk, 1, d_I) (one key head shared by the indexer
    heads; the queries are the last Lq positions), or packed (T, H_I, d_I) / (T, 1, d_I) with
    ``cu_seqlens_q`` (int32, B + 1 offsets) and optionally ``cu_seqlens_k``; ``head_weights``
    (B, Lq, H_I) or (Tq, H_I) in q's dtype, the pre-activation w_tj; ``bias`` (H_I) or (1),
    float32 (float64 for float64 inputs), absent meaning 0. ``scale`` defaults to 1 / sqrt(d_I).

    ``budget``: ``"inverse_variance"`` k_base * mean_variance / Var_t (003's text, the
    default), ``"eq8"`` k_base * Var_t / mean_variance (003's eq. 8 as printed),
    ``"reference"`` k_base * (0.5 + 1 / (1 + Var_t / mean_variance)) (003's public code), each
    floored and clamped to [k_min, k_max]; ``"fixed"``: ``k_fixed`` keys per row (default
    k_max). ``mean_variance`` is the layer's running mean of the row variance (Vbar).

    Returns ``(indices, counts, variance)``: indices int32 (B, Lq, k_max) or (Tq, k_max), the
    selected positions of each row in increasing order, -1 padded; counts int32 (B, Lq) or (Tq),
    min(k_t, t + 1); variance (B, Lq) or (Tq), float32 (float64 for float64 inputs). None of
    them is differentiable (the indexer learns from its own loss, spec/gsa.md).
    """
    return torch.ops.winnow.gsa_select_keys(
        q, k, head_weights, bias, k_max=k_max, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, form=form, scale=scale, budget=budget, k_fixed=k_fixed,
        k_base=k_base, k_min=k_min, mean_variance=mean_variance)


def gsa_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    trusted: bool = False,
) -> torch.Tensor:
    """Softmax attention of every query over its own key list (GSA's sparse SDPA, 003 eq. 6):
    ``o_t,h = sum_{s in S_t} softmax_{s in S_t}(<q_t,h, k_s> * scale) v_s``.

    ``indices`` and ``counts`` are the lists as :func:`gsa_select_keys` returns them: int32
    (B, Lq, k_max) or (Tq, k_max) positions in the sequence, strictly increasing and at most the
    query's own position in the first counts[t] slots, and int32 counts (B, Lq) or (Tq); one list
    per token, shared by all its heads. An empty list outputs zero. Shapes of q, k, v, the
    offsets and ``scale`` as in :func:`softmax_attention` (grouped-query heads, Dv may differ
    from D). Differentiable in q, k and v; keys in no list get zero gradient (with
    ``torch.use_deterministic_algorithms(True)`` the key gradients are the same bits on every
    run).

    Every list entry is checked before the forward (on CUDA the host waits for the check);
    ``trusted=True`` skips that for lists that come unchanged from :func:`gsa_select_keys`
    (a bad trusted list gives unspecified results, never a read outside the sequence). The
    backward reuses the forward's lists without checking them again.
    """
    return torch.ops.winnow.gsa_sparse_attention(
        q, k, v, indices, counts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        scale=scale, trusted=trusted)


def gsa_indexer_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    head_weights: torch.Tensor,
    bias: Optional[torch.Tensor],
    attention_q: torch.Tensor,
    attention_k: torch.Tensor,
    indices: Optional[torch.Tensor] = None,
    counts: Optional[torch.Tensor] = None,
    *,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    form: str = "sigmoid",
    scale: Optional[float] = None,
    attention_scale: Optional[float] = None,
) -> torch.Tensor:
    """GSA's indexer loss (003 section 6), per query row:
    ``KL_t = sum_{s in S_t} p_ts (log p_ts - log softmax_{s in S_t}(I_ts))``, with ``p_t`` the
    mean over attention_q's heads of ``softmax(<attention_q, attention_k> * attention_scale)``
    over the same set.

    ``S_t`` is the row's list (``indices`` and ``counts`` as :func:`gsa_select_keys` returns
    them: the sparse phase) or, without lists, every visible key (the dense warm-up). The
    indexer's operands (``q``, ``k``, ``head_weights``, ``bias``, ``form``, ``scale``) as
    :func:`gsa_select_keys` takes them; attention_q (B, Lq, H, D) and attention_k (B, Lk, H_kv,
    D) (or packed) in q's dtype, over the same sequences. Returns (B, Lq) or (Tq), float32
    (float64 for float64 inputs); differentiable in q, k, head_weights and bias, while
    attention_q and attention_k are the target and get no gradient. No L x L matrix is formed:
    memory is O(L).
    """
    return torch.ops.winnow.gsa_indexer_loss(
        q, k, head_weights, bias, attention_q, attention_k, indices, counts,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, form=form, scale=scale,
        attention_scale=attention_scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mechanism: str = "softmax",
    scale: Optional[float] = None,
    attend_current: Optional[bool] = None,
    trusted: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoding step against a paged key/value cache (vLLM's and FlashInfer's layout).

    ``k_cache`` (num_pages, page_size, Hkv, D) and ``v_cache`` (num_pages, page_size, Hkv, Dv)
    hold pages of key and value rows; ``block_table`` int32 (B, max_pages) lists each
    sequence's pages in order, so key i of sequence b is row ``i % page_size`` of page
    ``block_table[b, i // page_size]``; ``seq_lens`` int32 (B) counts the keys each sequence
    holds, its newest tokens included. ``q`` (B, Lq, Hq, D) holds those newest Lq tokens' queries:
    query r of sequence b sits at position ``seq_lens[b] - Lq + r``. ``mechanism`` is
    ``"softmax"`` (returns out and the log-sum-exp) or ``"stick_breaking"`` (out and log_rem);
    ``attend_current`` defaults to each mechanism's own (True for softmax, False for
    stick-breaking). On CUDA the keys are split across thread blocks and merged exactly
    (float16, bfloat16 and float32; D and Dv multiples of 8 up to 256).

    The lengths and the pages in use are checked first (on CUDA the host waits for the check);
    ``trusted=True`` skips that for tables the caller maintains itself (a bad trusted table reads
    out of bounds). Not differentiable: decoding is inference.
    """
    return torch.ops.winnow.paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, mechanism=mechanism, scale=scale,
        attend_current=attend_current, trusted=trusted)


def rotary_embedding(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool = False
) -> torch.Tensor:
    """Rotary position embedding as one kernel: the pairs (i, i + D/2) of every head vector of
    x (B, L, H, D) turn by their position's angle,
    ``y_i = x_i cos_li - x_{i+D/2} sin_li`` and ``y_{i+D/2} = x_{i+D/2} cos_li + x_i sin_li``.

    ``cos`` and ``sin``: (L, D/2) tables (float32, or float64 for float64 x) that carry any
    attention factor (YaRN's). ``transpose=True`` rotates by the negated angle: the gradient of
    the forward. Differentiable in x (the tables get no gradient); float32 and float64 on the
    CPU, every float dtype on CUDA.
    """
    return torch.ops.winnow.rotary_embedding(x, cos, sin, transpose)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
    out_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """RMSNorm over the last dimension as one kernel each way:
    ``y = x / sqrt(mean(x^2, -1) + eps) * weight``.

    ``weight``: (C,), float32 (float64 for float64 x). ``out_dtype``: y's dtype (default x's);
    on CUDA a float32 x can be normalized straight into bfloat16 or float16, the operand of the
    next matrix product under autocast, without a cast in between (the CPU writes x's dtype
    only). Statistics in float32 (float64 for float64 x). Differentiable in x and weight; the
    weight gradient is summed in a fixed order (repeatable bit for bit). float32 and float64
    on the CPU, every float dtype on CUDA.
    """
    return torch.ops.winnow.rms_norm(x, weight, eps, out_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
    out_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A transformer's residual add and the RMSNorm after it, one kernel each way: returns
    ``(s, rms_norm(s, weight, eps))`` with ``s = x + residual``.

    ``s`` has x's dtype (the residual stream, e.g. float32); ``residual`` (the branch output) and
    the normalized output have ``out_dtype`` (default x's), e.g. bfloat16 under autocast on CUDA.
    The backward adds the gradient that reaches ``s`` from its other uses to the norm's and
    writes it for x and, cast, for residual: no separate add, accumulation or cast. Same dtypes
    and devices as :func:`rms_norm`; differentiable in x, residual and weight.
    """
    return torch.ops.winnow.add_rms_norm(x, residual, weight, eps, out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate ``silu(gate) * up`` as one kernel each way (the element-wise middle of a
    SwiGLU MLP): gate and up of one shape and dtype, any layout. Arithmetic in float32 (float64
    for float64 tensors); differentiable in both. float32 and float64 on the CPU, every float
    dtype on CUDA.
    """
    return torch.ops.winnow.swiglu(gate, up)


# Modules built on the functions above (imported last: they use them).
from . import composed  # noqa: E402
from . import nn  # noqa: E402

