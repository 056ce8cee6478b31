"""Host latency of threshold attention beside SDPA and softmax: per-call medians with one and with
four calls between the CUDA events (what the host adds shows as the difference), and the GPU
timeline of one TDA forward+backward (its gaps, the host operations that took longest).

  WINNOW_LIBRARY=build-gpu/libwinnow_torch.so python3 bench/latency_probe.py
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_attention_bench import median_ms  # noqa: E402
from gpu_threshold_bench import methods  # noqa: E402

m = methods()
for L in (4096, 16384):
    B = 16384 // L
    leaves = [torch.randn(B, L, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(5)]
    extra = (torch.ones(1, device="cuda", requires_grad=True), torch.full((1,), 0.5, device="cuda", requires_grad=True))
    for name in ("sdpa_flash", "winnow_softmax", "winnow_tra", "winnow_tda"):
        fn = m[name]
        run = lambda: fn(*leaves[:3], leaves[3], leaves[4], *extra)
        out = run(); grad = torch.randn_like(out)
        inputs = [t for t in leaves + list(extra) if t.requires_grad]
        fb = lambda: torch.autograd.grad(run(), inputs, grad, allow_unused=True)
        r = [median_ms(run, inner=1), median_ms(run, inner=4), median_ms(fb, inner=1), median_ms(fb, inner=4)]
        print(f"L {L} {name:16s} fwd {r[0]:.3f} / {r[1]:.3f} (inner 4)   f+b {r[2]:.3f} / {r[3]:.3f} (inner 4)", flush=True)
        if name == "winnow_tda":
            for _ in range(3): fb()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fb(); torch.cuda.synchronize()
            ks = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                        key=lambda e: e.time_range.start)
            busy = sum(e.time_range.end - e.time_range.start for e in ks)
            span = ks[-1].time_range.end - ks[0].time_range.start
            print(f"  TDA f+b: {len(ks)} GPU ops, busy {busy/1e3:.3f} ms, first-to-last {span/1e3:.3f} ms")
            gaps = []
            for a, b in zip(ks, ks[1:]):
                gaps.append((b.time_range.start - a.time_range.end, a.name[:60], b.name[:60]))
            for g, a, b in sorted(gaps, reverse=True)[:6]:
                print(f"    gap {g/1e3:.3f} ms after {a} before {b}")
            cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
            top = sorted(cpu, key=lambda e: -(e.time_range.end - e.time_range.start))[:12]
            for e in top:
                print(f"    cpu {e.name[:70]:70s} {(e.time_range.end - e.time_range.start)/1e3:.3f} ms")
