"""The model and training step of `winnow train-bench` in plain PyTorch (issue 11), eager and
torch.compile, with tokens/s printed beside winnow's.

What is mirrored, read from the C++ (src/nn/, src/train/, src/tasks/, apps/train.cpp):
- Model (nn/transformer.cpp, nn/modules.cpp, nn/config.cpp): token embedding (vocab 64,
  d_model 256), 2 pre-norm blocks x + attn(RMSNorm(x)), h + mlp(RMSNorm(h)), a final RMSNorm,
  the output head tied to the embedding. RMSNorm: learned scale (ones), eps 1e-6, statistics in
  float32, result cast back to the input's dtype. SwiGLU MLP down(silu(gate(x)) * up(x)),
  hidden (8 d + 2) // 3 rounded up to 64 = 704. Attention: q, k, v, o projections, 4 heads of
  64, scale 1/8. No biases anywhere.
- Init (seed 1, torch.manual_seed before the model is built on the CPU, then moved): every
  weight ~ N(0, 0.02), except o and down, N(0, 0.02 / sqrt(2 layers)); norm scales 1. The
  modules are built in winnow's order with nn.Embedding / nn.Linear, whose default init
  draws from the generator as LibTorch's does, so with the same torch version on the CPU
  generator the weights come out identical to winnow's (the initial loss check relies on it).
- RoPE (Rope::apply): half-split pairs (i, i + D/2), base 10000, cos/sin tables in float64
  then float32, applied in float32 to q and k and cast back; then softmax attention with
  keys j <= i (F.scaled_dot_product_attention, is_causal=True).
- Stick-breaking (composed::stick_breaking_over, spec/stick-breaking.md): keys i < j only
  (attend_current false), no positional encoding (NoPE, winnow's default for this kind), no
  remainder bias or head norm. Materialized: z = scale q.k in float32,
  log A_ij = z_ij + sum_{i <= k < j} log(1 - sigmoid(z_kj)) (log-sigmoid, a reverse cumulative
  sum over the keys from the query back), A masked to 0 elsewhere, out = A v.
- Step (Trainer::step): bf16 autocast on CUDA (float32 on the CPU), loss = mean cross entropy
  in float32 over positions 1..L-1 (the task's loss mask leaves out position 0), backward,
  AdamW lr 1e-3 constant, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices (the tied
  embedding included) and 0 on the norm scales, gradients set to None each step, no clipping.
- Data (tasks/task.cpp): the progression task, a_t = (a + d t) mod 64 with a uniform in
  [0, 64) and d in [1, 63] per sequence, from std::mt19937_64 seeded with winnow's
  batch_seed(seed, stream 1, step): the very batches winnow trains on, step for step.
  batch = tokens // L sequences of L tokens.

Not mirrored, on purpose: winnow computes the gradient norm and reads the loss on the host every
step (a synchronization); this baseline keeps the loss on the device and does neither, as a
PyTorch user's loop would. Batches are generated before the timed loop (the pure-Python
mt19937_64 would otherwise be measured) and copied to the device inside each step, as winnow's
step does. torch.compile compiles the forward pass and the loss; AdamW runs eagerly (--adamw
picks its implementation).

Usage (GPU):
  build-gpu/apps/winnow train-bench --device cuda --kinds softmax_rope,stick_breaking \\
      --json gpu-out/train_bench_winnow.json
  python3 bench/train_baseline.py --device cuda --winnow-json gpu-out/train_bench_winnow.json \\
      --json gpu-out/train_baseline.json
(or --winnow build-gpu/apps/winnow to run it from here; tools/gpu_check.sh trainbench does both).
CPU smoke test: python3 bench/train_baseline.py --device cpu --tokens small
"""

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Configuration: apps/train.cpp's train-bench experiment with nn/config.h's defaults.

VOCAB = 64
D_MODEL = 256
LAYERS = 2
HEADS = 4
HEAD_DIM = D_MODEL // HEADS
MLP_HIDDEN = ((8 * D_MODEL + 2) // 3 + 63) // 64 * 64  # 704
NORM_EPS = 1e-6
INIT_STD = 0.02
ROPE_THETA = 10000.0
LR, BETAS, ADAM_EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
TRAIN_STREAM = 1  # trainer.cpp's kTrainStream

KINDS = {
    # name: (attention, position), named as train-bench's kinds
    "softmax_rope": ("softmax", "rope"),
    "softmax_nope": ("softmax", "nope"),
    "stick_breaking": ("stick_breaking", "nope"),
}
SMALL_TOKENS = 256
SMALL_LENGTHS = "16,64"


def parameter_count_formula(vocab=VOCAB, d=D_MODEL, layers=LAYERS, hidden=MLP_HIDDEN):
    """Embedding (tied head), per layer two norm scales, q k v o and the three SwiGLU
    matrices, and the final norm's scale."""
    return vocab * d + layers * (2 * d + 4 * d * d + 3 * d * hidden) + d


# ---------------------------------------------------------------------------------------------
# The progression task's batches, exactly as winnow draws them (std::mt19937_64 raw output).

MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (raw 64-bit output), so the batches equal winnow's."""

    def __init__(self, seed):
        mt = [seed & MASK64]
        for i in range(1, 312):
            mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & MASK64)
        self.mt, self.index = mt, 312

    def _twist(self):
        mt = self.mt
        for i in range(312):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
            xa = x >> 1
            if x & 1:
                xa ^= 0xB5026F5AA96619E9
            mt[i] = mt[(i + 156) % 312] ^ xa
        self.index = 0

    def __call__(self):
        if self.index >= 312:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64

    def below(self, n):
        """Rng::below: uniform in [0, n) by rejection."""
        limit = (MASK64 // n) * n
        x = self()
        while x >= limit:
            x = self()
        return x % n


def batch_seed(run_seed, stream, index):
    """tasks::batch_seed: SplitMix64's finalizer over a mix of the three numbers."""
    x = (run_seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9
         + index * 0x94D049BB133111EB) & MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def progression_batch(batch, length, seed, vocab=VOCAB):
    """(inputs, targets), (batch, length) int64: Progression::sample."""
    rng = MT19937_64(seed)
    a, d = [], []
    for _ in range(batch):
        a.append(rng.below(vocab))
        d.append(1 + rng.below(vocab - 1))
    t = torch.arange(length + 1, dtype=torch.int64)
    seq = (torch.tensor(a, dtype=torch.int64)[:, None]
           + torch.tensor(d, dtype=torch.int64)[:, None] * t) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# The model.

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def linear(d_in, d_out, std):
    """nn.Linear without bias; its default (kaiming-uniform) init draws first, as LibTorch's
    does in make_linear, then the weights are redrawn from N(0, std)."""
    layer = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0.0, std)
    return layer


def rope_tables(length, head_dim=HEAD_DIM, theta=ROPE_THETA):
    """cos and sin (L, D) in float64: Rope::compute without scaling."""
    i = torch.arange(0, head_dim // 2, dtype=torch.float64)
    inv_freq = torch.pow(theta, -2.0 * i / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    full = torch.cat([angles, angles], -1)
    return full.cos(), full.sin()


def apply_rope(x, cos, sin):
    """x (B, L, H, D); rotates the pairs (i, i + D/2) in float32, returns x's dtype."""
    xw = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xw[..., half:], xw[..., :half]], -1)
    return (xw * cos + rotated * sin).to(x.dtype)


def work_type(x):
    """Scores in float32 (float64 for float64 inputs), as composed.cpp forms them."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_softmax_composed(q, k, v, scale):
    """Fallback for torch without scaled_dot_product_attention (1.13): (B, H, L, D)."""
    L = q.shape[-2]
    z = (q @ k.transpose(-1, -2)).to(work_type(q)) * scale
    visible = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(z.masked_fill(~visible, float("-inf")), -1)
    return p.to(v.dtype) @ v


HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")


def stick_breaking_composed(q, k, v, scale):
    """Materialized causal stick-breaking over keys i < j, (B, H, L, D):
    A_ij = sigmoid(z_ij) prod_{i < k < j} (1 - sigmoid(z_kj)), in log space
    log A_ij = z_ij + sum_{k >= i visible} log(1 - sigmoid(z_kj)), the sum a reverse cumulative
    sum from the query back (log(1 - sigmoid z) = logsigmoid(-z))."""
    L = q.shape[-2]
    z = (q @ k.transpose(-1, -2)).to(work_type(q)) * scale
    hidden = ~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
    # Hidden logits are zeroed before exp, so no inf reaches the gradient of masked entries.
    zm = z.masked_fill(hidden, 0.0)
    log_keep = F.logsigmoid(-zm).masked_fill(hidden, 0.0)
    suffix = log_keep.flip(-1).cumsum(-1).flip(-1)
    w = torch.exp(zm + suffix).masked_fill(hidden, 0.0)
    return w.to(v.dtype) @ v


class Attention(nn.Module):
    def __init__(self, kind, position):
        super().__init__()
        self.kind, self.position = kind, position
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        out_std = INIT_STD / math.sqrt(2.0 * LAYERS)
        self.q = linear(D_MODEL, HEADS * HEAD_DIM, INIT_STD)
        self.k = linear(D_MODEL, HEADS * HEAD_DIM, INIT_STD)
        self.v = linear(D_MODEL, HEADS * HEAD_DIM, INIT_STD)
        self.o = linear(HEADS * HEAD_DIM, D_MODEL, out_std)

    def forward(self, x, rope):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, HEADS, HEAD_DIM)
        k = self.k(x).view(B, L, HEADS, HEAD_DIM)
        v = self.v(x).view(B, L, HEADS, HEAD_DIM)
        if self.position == "rope":
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # (B, H, L, D), q and k back in v's dtype (the rotation returns theirs; under autocast
        # all three are bf16 here, as the layers hand them to winnow's operators)
        q, k, v = q.to(v.dtype).transpose(1, 2), k.to(v.dtype).transpose(1, 2), v.transpose(1, 2)
        if self.kind == "stick_breaking":
            o = stick_breaking_composed(q, k, v, self.scale)
        elif HAVE_SDPA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = causal_softmax_composed(q, k, v, self.scale)
        return self.o(o.transpose(1, 2).reshape(B, L, HEADS * HEAD_DIM))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = linear(D_MODEL, MLP_HIDDEN, INIT_STD)
        self.gate = linear(D_MODEL, MLP_HIDDEN, INIT_STD)
        self.down = linear(MLP_HIDDEN, D_MODEL, INIT_STD / math.sqrt(2.0 * LAYERS))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, kind, position):
        super().__init__()
        # Built in BlockImpl's order: the generator's draws follow construction order.
        self.attention_norm = RMSNorm(D_MODEL)
        self.attention = Attention(kind, position)
        self.mlp_norm = RMSNorm(D_MODEL)
        self.mlp = SwiGLU()

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.mlp(self.mlp_norm(h))


class TransformerLM(nn.Module):
    def __init__(self, kind, position, max_len):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D_MODEL)  # default init N(0, 1) draws, as LibTorch's
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, INIT_STD)
        self.blocks = nn.ModuleList([Block(kind, position) for _ in range(LAYERS)])
        self.final_norm = RMSNorm(D_MODEL)
        cos, sin = rope_tables(max_len)
        self.register_buffer("rope_cos", cos.float()[None, :, None, :], persistent=False)
        self.register_buffer("rope_sin", sin.float()[None, :, None, :], persistent=False)

    def forward(self, tokens):
        L = tokens.shape[1]
        rope = (self.rope_cos[:, :L], self.rope_sin[:, :L])
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, rope)
        return F.linear(self.final_norm(x), self.embedding.weight)


def make_optimizer(model, adamw):
    """Trainer's groups: weight decay on matrices (dim >= 2), none on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    kwargs = {}
    if adamw in ("foreach", "fused"):
        kwargs[adamw] = True
    elif adamw == "for-loop":
        kwargs["foreach"] = False
    return torch.optim.AdamW([{"params": rest, "weight_decay": 0.0},
                              {"params": decay, "weight_decay": WEIGHT_DECAY}],
                             lr=LR, betas=BETAS, eps=ADAM_EPS, **kwargs)


# ---------------------------------------------------------------------------------------------
# One measurement: a fresh model (seed 1) per kind, length and mode, as train-bench does.

def have_compile():
    return hasattr(torch, "compile")


def run_one(kind, mode, L, args, device, batches):
    attention, position = KINDS[kind]
    torch.manual_seed(args.seed)
    model = TransformerLM(attention, position, L)
    parameters = sum(p.numel() for p in model.parameters())
    model.to(device)
    model.train()
    optimizer = make_optimizer(model, args.adamw)
    autocast = device.type == "cuda"

    def forward_loss(inputs, targets):
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model(inputs)
        return F.cross_entropy(logits[:, 1:].float().reshape(-1, VOCAB), targets[:, 1:].reshape(-1))

    loss_fn = forward_loss
    if mode == "compile":
        torch._dynamo.reset()
        kwargs = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
        loss_fn = torch.compile(forward_loss, **kwargs)

    def step(i):
        inputs, targets = batches[i]
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(inputs, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses = []
    compile_start = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(i))
        if i == 0:
            sync()
            first_step_s = time.perf_counter() - compile_start
    sync()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(i))
    sync()
    seconds = time.perf_counter() - start
    losses = [float(x) for x in losses]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"training diverged: losses {losses}")
    batch = batches[0][0].shape[0]
    record = {
        "kind": kind, "mode": mode, "L": L, "batch": batch, "parameters": parameters,
        "initial_loss": losses[0], "final_loss": losses[-1],
        "tokens_per_s": args.steps * batch * L / seconds,
        "ms_per_step": 1e3 * seconds / args.steps,
    }
    if args.warmup > 0:
        record["first_step_s"] = first_step_s
    if args.profile and device.type == "cuda":
        try:
            record["profile"] = profile_steps(step, sync, min(5, len(batches)))
        except Exception as e:  # the timing stands without it
            record["profile_error"] = repr(e)
    if mode == "compile":
        torch._dynamo.reset()  # drops the compiled graph, which holds on to this model
    return record


def profile_steps(step, sync, steps):
    """Kernel time per step over `steps` more steps (on the first batches again) under
    torch.profiler: GPU busy time, the number of kernels, and the largest kernels by total time
    (compare with train-bench --profile)."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        sync()
    kernels = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total, count = kernels.get(e.name, (0.0, 0))
        kernels[e.name] = (total + e.time_range.elapsed_us() / 1e3, count + 1)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "gpu_busy_ms_per_step": sum(t for t, _ in kernels.values()) / steps,
        "gpu_ops_per_step": sum(n for _, n in kernels.values()) / steps,
        "top_gpu_ops": [{"name": name, "ms": t / steps, "count": n / steps} for name, (t, n) in top[:25]],
    }


# ---------------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--lengths", default=None,
                   help="sequence lengths, comma-separated (default 64,1024; %s with --tokens small)"
                   % SMALL_LENGTHS)
    p.add_argument("--tokens", default="65536",
                   help="tokens per optimizer step (batch = tokens // L), or 'small' (%d) for a "
                   "CPU smoke test (default 65536)" % SMALL_TOKENS)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    p.add_argument("--kinds", default="softmax_rope,stick_breaking",
                   help="subset of %s (default softmax_rope,stick_breaking)" % ", ".join(KINDS))
    p.add_argument("--modes", default="eager,compile", help="eager, compile (default both)")
    p.add_argument("--compile-mode", default="default",
                   help="torch.compile mode: default, reduce-overhead, max-autotune, "
                   "max-autotune-no-cudagraphs (default: default)")
    p.add_argument("--adamw", default="default", choices=["default", "foreach", "fused", "for-loop"],
                   help="AdamW implementation (default: torch's default, foreach on CUDA)")
    p.add_argument("--seed", type=int, default=1, help="winnow's experiment seed (default 1)")
    p.add_argument("--winnow-json", default=None, help="a `winnow train-bench --json` file to compare with")
    p.add_argument("--winnow", default=None,
                   help="the winnow binary: run train-bench with the same settings and compare")
    p.add_argument("--loss-tol", type=float, default=None,
                   help="largest accepted |initial loss - winnow's| (default 1e-4 on the CPU, "
                   "2e-3 under bf16 on CUDA)")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--profile", action="store_true",
                   help="on CUDA: after timing, profile 5 steps and report GPU busy time and the "
                   "largest kernels per step")
    args = p.parse_args(argv)
    if args.tokens == "small":
        args.tokens = SMALL_TOKENS
        if args.lengths is None:
            args.lengths = SMALL_LENGTHS
    else:
        try:
            args.tokens = int(args.tokens)
        except ValueError:
            p.error("argument --tokens: expected a positive integer or 'small', got %r" % args.tokens)
        if args.tokens < 2:
            p.error("argument --tokens: expected at least 2, got %d" % args.tokens)
    if args.lengths is None:
        args.lengths = "64,1024"
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        p.error("argument --lengths: expected comma-separated integers, got %r" % args.lengths)
    for L in args.lengths:
        if not 2 <= L <= args.tokens:
            p.error("argument --lengths: expected integers in [2, --tokens], got %d" % L)
    args.kinds = [k for k in args.kinds.split(",") if k]
    for k in args.kinds:
        if k not in KINDS:
            p.error("argument --kinds: expected names from %s, got %r" % (", ".join(KINDS), k))
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in ("eager", "compile"):
            p.error("argument --modes: expected eager and/or compile, got %r" % m)
    if args.steps < 1 or args.warmup < 0:
        p.error("arguments --steps >= 1 and --warmup >= 0 expected")
    if args.winnow and args.winnow_json:
        p.error("give --winnow or --winnow-json, not both")
    return args


def pick_device(name):
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("argument --device: this torch sees no CUDA device")
    return device


def run_winnow(args, device):
    """winnow train-bench with this run's settings; returns its JSON."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="winnow-train-bench-")
    os.close(fd)
    kinds = ",".join(args.kinds)
    cmd = [args.winnow, "train-bench", "--device", str(device), "--lengths",
           ",".join(str(L) for L in args.lengths), "--tokens", str(args.tokens), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--kinds", kinds, "--json", path]
    print("running:", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def winnow_record(winnow, kind, L):
    if not winnow:
        return None
    for r in winnow.get("results", []):
        if r.get("kind") == kind and r.get("L") == L:
            return r
    return None


def fmt_rate(x):
    return "%.3f M" % (x / 1e6) if x is not None else "-"


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.loss_tol is None:
        args.loss_tol = 2e-3 if device.type == "cuda" else 1e-4
    print("torch %s, device %s%s" % (torch.__version__, device,
          " (%s)" % torch.cuda.get_device_name(device) if device.type == "cuda" else ""))
    notes = []
    modes = list(args.modes)
    if "compile" in modes and not have_compile():
        notes.append("torch.compile skipped: torch %s has no torch.compile (it needs PyTorch >= 2.0)"
                     % torch.__version__)
        modes.remove("compile")
    if not HAVE_SDPA and any(KINDS[k][0] == "softmax" for k in args.kinds):
        notes.append("softmax runs composed (materialized): torch %s has no "
                     "F.scaled_dot_product_attention" % torch.__version__)
    for n in notes:
        print("note:", n)

    winnow = None
    if args.winnow:
        winnow = run_winnow(args, device)
    elif args.winnow_json:
        with open(args.winnow_json) as f:
            winnow = json.load(f)
    if winnow:
        if winnow.get("tokens_per_step") != args.tokens or winnow.get("timed_steps") != args.steps:
            print("warning: winnow's JSON has tokens_per_step %s, timed_steps %s; this run %d, %d"
                  % (winnow.get("tokens_per_step"), winnow.get("timed_steps"), args.tokens, args.steps))
        if winnow.get("device") and str(winnow["device"]).split(":")[0] != device.type:
            print("warning: winnow ran on %s, this run on %s" % (winnow["device"], device))

    formula = parameter_count_formula()
    failures = []
    results = []
    print("winnow: train-bench's tokens/s for the same kind (fused operator); w/this: winnow's "
          "tokens/s over this row's")
    print("%6s %6s  %-16s %-8s %12s %9s %12s %12s %10s %9s" % (
        "L", "batch", "kind", "mode", "tokens/s", "ms/step", "init loss", "winnow loss",
        "winnow", "w/this"))
    for L in args.lengths:
        batch = max(1, args.tokens // L)
        batches = [progression_batch(batch, L, batch_seed(args.seed, TRAIN_STREAM, i))
                   for i in range(args.warmup + args.steps)]
        if device.type == "cuda":
            batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        for kind in args.kinds:
            w = winnow_record(winnow, kind, L)
            for mode in modes:
                try:
                    r = run_one(kind, mode, L, args, device, batches)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()  # the last model's memory, before the next
                except Exception as e:  # an out-of-memory or compile failure: report, go on
                    msg = str(e).strip().split("\n")[0]
                    r = {"kind": kind, "mode": mode, "L": L, "batch": batch, "error": msg}
                    print("%6d %6d  %-16s %-8s error: %s" % (L, batch, kind, mode, msg), flush=True)
                    results.append(r)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if r["parameters"] != formula:
                    failures.append("%s: %d parameters, formula %d" % (kind, r["parameters"], formula))
                if w is not None:
                    r["winnow_tokens_per_s"] = w.get("tokens_per_s")
                    r["winnow_initial_loss"] = w.get("initial_loss")
                    r["winnow_parameters"] = w.get("parameters")
                    if r["winnow_tokens_per_s"]:
                        r["winnow_over_this"] = r["winnow_tokens_per_s"] / r["tokens_per_s"]
                    if r["winnow_parameters"] is not None and r["winnow_parameters"] != r["parameters"]:
                        failures.append("%s L=%d: %d parameters, winnow %d" % (
                            kind, L, r["parameters"], r["winnow_parameters"]))
                    if r["winnow_initial_loss"] is not None:
                        diff = abs(r["initial_loss"] - r["winnow_initial_loss"])
                        r["initial_loss_diff"] = diff
                        if diff > args.loss_tol:
                            failures.append("%s %s L=%d: initial loss %.6f, winnow %.6f (|diff| %.2e > %.0e)"
                                            % (kind, mode, L, r["initial_loss"],
                                               r["winnow_initial_loss"], diff, args.loss_tol))
                results.append(r)
                print("%6d %6d  %-16s %-8s %12s %9.2f %12.6f %12s %10s %9s" % (
                    L, batch, kind, mode, fmt_rate(r["tokens_per_s"]), r["ms_per_step"],
                    r["initial_loss"],
                    "%.6f" % r["winnow_initial_loss"] if r.get("winnow_initial_loss") is not None else "-",
                    fmt_rate(r.get("winnow_tokens_per_s")),
                    "%.2fx" % r["winnow_over_this"] if "winnow_over_this" in r else "-"), flush=True)
                if "profile" in r:
                    prof = r["profile"]
                    print("        GPU busy %.3f ms/step, %.0f kernels/step; largest:" % (
                        prof["gpu_busy_ms_per_step"], prof["gpu_ops_per_step"]))
                    for op in prof["top_gpu_ops"][:12]:
                        print("        %8.3f ms %5.1fx  %s" % (op["ms"], op["count"], op["name"][:100]))

    # The table: winnow (fused and composed) beside eager and compile, with ratios.
    print()
    counts = sorted({r["parameters"] for r in results if "parameters" in r})
    winnow_counts = sorted({r["parameters"] for r in (winnow or {}).get("results", [])
                            if r.get("kind") in args.kinds and "parameters" in r})
    print("parameters: %s (formula %d; winnow %s)" % (
        ", ".join(str(c) for c in counts) or "-", formula,
        ", ".join(str(c) for c in winnow_counts) or "-"))
    print()
    print("| tokens/s (millions) | winnow | winnow composed | PyTorch eager | torch.compile "
          "| winnow / eager | winnow / compile |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    table = []
    for kind in args.kinds:
        for L in args.lengths:
            row = {"kind": kind, "L": L}
            w = winnow_record(winnow, kind, L)
            wc = winnow_record(winnow, kind + "@composed", L)
            row["winnow"] = w.get("tokens_per_s") if w else None
            row["winnow_composed"] = wc.get("tokens_per_s") if wc else None
            for mode in ("eager", "compile"):
                r = next((r for r in results if r["kind"] == kind and r["L"] == L
                          and r["mode"] == mode and "tokens_per_s" in r), None)
                row[mode] = r["tokens_per_s"] if r else None
            cells = []
            for key in ("winnow", "winnow_composed", "eager", "compile"):
                cells.append("%.2f" % (row[key] / 1e6) if row[key] else "-")
            for key in ("eager", "compile"):
                if row["winnow"] and row[key]:
                    row["winnow_over_" + key] = row["winnow"] / row[key]
                    cells.append("%.2fx" % row["winnow_over_" + key])
                else:
                    cells.append("-")
            table.append(row)
            print("| %s, L = %d | %s |" % (kind, L, " | ".join(cells)))
    print()
    if failures:
        print("CHECK FAILED:")
        for f in failures:
            print("  " + f)
    else:
        checked = "parameter count = formula"
        if winnow:
            checked += ", = winnow's, initial loss within %.0e of winnow's" % args.loss_tol
        print("checks passed: " + checked)

    if args.json:
        out = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "model": "2 layers, d_model 256, 4 heads of 64, SwiGLU 704, vocab 64, tied embeddings",
            "parameters_formula": formula,
            "tokens_per_step": args.tokens,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "compile_mode": args.compile_mode,
            "adamw": args.adamw,
            "notes": notes,
            "winnow_json": args.winnow_json,
            "results": results,
            "table": table,
            "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 1 if failures or any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
