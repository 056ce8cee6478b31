"""Where a method's time goes, kernel by kernel: runs the forward and the backward of the
benchmark's methods (gpu_attention_bench.py: same names, same inputs) under torch.profiler and
prints each CUDA kernel's time per call, so a change to one sweep of a multi-sweep mechanism
(entmax's threshold search, its output sweep, the backward's U sweep) can be predicted and
checked on its own. Each phase's heading also gives the call's time between CUDA events (as the
benchmarks time it), the same with the host's dispatch hidden behind a GPU-side wait (their
difference is the host time before the first launch that a benchmark counts, measured without
the profiler), and its host time: where the first exceeds the kernels' sum, the last says
whether the GPU waited for the host. A timeline line under it splits that excess: how long
after the call began on the host its first GPU work started (the host's dispatch, which a
benchmark's start event counts), and how much of the GPU's span idled between the call's
kernels, copies and memsets.

  python3 bench/kernel_breakdown.py --lengths 4096 16384 --methods winnow_entmax15 adasplash2_entmax15
  python3 bench/kernel_breakdown.py --lengths 4096 --phases forward inference   # with and without gradients

Threshold attention's methods (gpu_threshold_bench.py: winnow_tra, winnow_tda_beta1_screen, ...)
run on that bench's inputs instead: two query/key views, beta and lambda as tensors with
gradients.
"""

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_attention_bench as bench  # noqa: E402
import gpu_threshold_bench as threshold_bench  # noqa: E402


def kernel_times(fn, calls):
    """kernel name -> (total microseconds per call, launches per call)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[e.name]
            t[0] += e.device_time / calls
            t[1] += 1
    return {name: (us, n / calls) for name, (us, n) in totals.items()}


MARK = "kernel_breakdown_call"


def profiled_calls(fn, calls):
    """Runs fn `calls` times under the profiler (host and GPU), each call marked and from an
    idle GPU. Returns the marked calls' start times on the host, in order, and the other events
    from the first of them on. An unmarked call goes first: in a profile's first call the
    profiler sets up its activity buffers at the first CUDA call (2 ms, "Activity Buffer
    Request"; 2026-11-30). Host and device time stamps share one clock (Kineto aligns them) to
    within a microsecond or so."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(-1, calls):
            with torch.profiler.record_function(f"{MARK}_{i}" if i >= 0 else f"{MARK}_warm"):
                fn()
            torch.cuda.synchronize()
    events = prof.events()
    # The host ranges only: a mark's GPU annotation spans its call's kernels.
    starts = sorted(e.time_range.start for e in events if e.name.startswith(MARK) and e.name != f"{MARK}_warm"
                    and e.device_type == torch.autograd.DeviceType.CPU)
    others = [e for e in events if not e.name.startswith(MARK) and e.time_range.start >= starts[0]]
    return starts, others


def timeline_us(fn, calls):
    """Medians over `calls` calls, each from an idle GPU: microseconds from the call's start on
    the host to its first GPU activity, the GPU's span from that start to the last activity's
    end, and the idle time inside the span."""
    calls_at, events = profiled_calls(fn, calls)
    device = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    dispatch, span, idle = [], [], []
    for i, begun in enumerate(calls_at):
        until = calls_at[i + 1] if i + 1 < len(calls_at) else float("inf")
        mine = [d for d in device if begun <= d[0] < until]
        if not mine:
            continue
        busy, reach = 0.0, mine[0][0]
        for start, end in mine:  # the union of the intervals, in start order
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        dispatch.append(mine[0][0] - begun)
        span.append(reach - mine[0][0])
        idle.append(span[-1] - busy)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return median(dispatch), median(span), median(idle)


def host_trace(fn, limit):
    """One call's host and GPU events in time order, microseconds from the call's start on the
    host: PyTorch's operators, the CUDA runtime's calls (launches, memsets, attribute calls,
    waits) and the GPU's kernels, copies and memsets. The host's own work between the runtime's
    calls shows as the gaps between them. The profiler adds a few microseconds to each event."""
    (begun,), events = profiled_calls(fn, 1)
    rows = sorted((e.time_range.start - begun, e.time_range.end - e.time_range.start,
                   "gpu" if e.device_type == torch.autograd.DeviceType.CUDA else "host", e.name) for e in events)
    for start, length, where, name in rows[:limit]:
        print(f"   {start:9.1f} us {length:9.1f} us  {where:4}  {short(name, 80)}")
    if len(rows) > limit:
        print(f"   ... {len(rows) - limit} more events")


def hidden_dispatch_ms(fn, wait_us=400.0, repeat=15):
    """The call's time between CUDA events with the host's dispatch hidden: a GPU-side wait
    (torch.cuda._sleep) queued after the start event and before the call keeps the GPU busy
    while the host prepares the call's first launches, and the wait's own time, measured alone,
    is taken off. Against bench.median_ms (the call from an idle GPU, as the benchmarks time it)
    the difference is the host time the benchmarks count, without the profiler's overhead; the
    wait must outlast the host's time to the first launch (its default, 400 us, does so several
    times over for the methods here). SDPA's default back end on bf16 at L 4096 (B 4, 12 heads of
    128; H200, 2026-11-30): 0.421-0.436 ms between events, 0.371-0.374 hidden, 0.362-0.367 of
    kernels, so 50-60 us of host time before its one kernel."""
    def cycles_for(us):  # _sleep counts clock cycles: calibrated on a wait of 10^6 of them
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return int(us * 1e-3 * 1_000_000 / start.elapsed_time(end))

    cycles_for(1.0)
    cycles = cycles_for(wait_us)

    def timed(with_call):
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            if with_call:
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]

    fn()
    timed(False)
    return timed(True) - timed(False)


def host_ms(fn, calls):
    """Host milliseconds per call of `calls` back-to-back calls, from an idle GPU, without
    waiting for the GPU between them: beside the kernels' time it says whether the GPU waits
    for the host (host time near or above the kernels') or the call waits for the GPU (a copy
    to the host and its synchronization count here too)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3 / calls


def short(name, width=90):
    name = name.replace("winnow::cuda::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--methods", nargs="+", default=["winnow_entmax15"])
    ap.add_argument("--inputs", choices=["random", "local"], default="random")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--phases", nargs="+", choices=["forward", "inference", "backward"],
                    default=["forward", "backward"],
                    help="forward (keeping what the backward needs), inference (the forward under no_grad), backward")
    ap.add_argument("--host-trace", type=int, default=0, metavar="N",
                    help="after each phase's kernels, its first N host and GPU events of one call")
    args = ap.parse_args()

    torch.manual_seed(0)
    heads = 12 if args.dim == 128 else 16
    available = bench.methods()
    threshold_methods = threshold_bench.methods()
    for L in args.lengths:
        B = max(1, args.tokens // L)
        q, k, v = bench.make_inputs(args.inputs, B, L, heads, args.dim)
        for name in args.methods:
            if name in available:
                prepare, fn = available[name]
                inputs = prepare(q, k, v)
            elif name in threshold_methods:
                # gpu_threshold_bench's inputs: q, k, v and the second view's q2, k2, with beta's
                # scale and lambda (the method multiplies the scale by its beta).
                fn = threshold_methods[name]
                views = [t.detach().requires_grad_() for t in (q, k, v, torch.randn_like(q), torch.randn_like(k))]
                inputs = views + [torch.ones(1, device="cuda", requires_grad=True),
                                  torch.full((1,), 0.5, device="cuda", requires_grad=True)]
            else:
                print(f"# {name}: not available")
                continue
            out = fn(*inputs)
            grad = torch.randn_like(out)
            def inference():
                with torch.no_grad():
                    return fn(*inputs)

            phases = {
                "forward": lambda: fn(*inputs),
                # Without gradients: entmax's output sweep then lists no supports (the plain
                # sweep), and Sieve's and the others' forwards save nothing for a backward.
                "inference": inference,
                "backward": lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True),
            }
            for phase in args.phases:
                call = phases[phase]
                times = kernel_times(call, args.calls)
                total = sum(us for us, _ in times.values())
                # The call's time between CUDA events, as the benchmarks time it: beyond the
                # kernels' sum it holds the gaps where the GPU waited for the host.
                wall = bench.median_ms(call)
                try:
                    hidden = hidden_dispatch_ms(call)
                    hidden_text = (f" ({hidden:.3f} with the host's dispatch hidden behind a GPU wait: "
                                   f"{(wall - hidden) * 1e3:.0f} us of it host time)")
                except Exception as e:  # noqa: BLE001  (torch.cuda._sleep is private API)
                    hidden_text = f" (hidden dispatch not measured: {type(e).__name__}: {e})"
                host = host_ms(call, args.calls)
                print(f"\n## L={L} B={B} {name} {phase}: {total / 1e3:.3f} ms of kernels per call, "
                      f"{wall:.3f} ms between events{hidden_text}, {host:.3f} ms on the host")
                try:
                    dispatch, span, idle = timeline_us(call, args.calls)
                    print(f"   timeline: first GPU work {dispatch:.0f} us after the call began on the host; "
                          f"GPU span {span:.0f} us, {idle:.0f} us of it idle between the call's kernels")
                except Exception as e:  # a profiler without aligned clocks or annotations: the kernels still print
                    print(f"   timeline: not available ({type(e).__name__}: {e})")
                for kname, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
                    print(f"{us / 1e3:9.3f} ms {us / total * 100:5.1f}% x{n:4.1f}  {short(kname)}")
                if args.host_trace > 0:
                    print("   one call's events (start, length, where, name):")
                    host_trace(call, args.host_trace)


if __name__ == "__main__":
    main()
