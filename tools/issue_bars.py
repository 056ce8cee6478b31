#!/usr/bin/env python3
"""The open issues' speed bars, read off benchmark JSON: one line per bar and shape, with the
measured ratio, the bar, and whether it holds.

    python3 tools/issue_bars.py gpu-out/bench.json gpu-out/decode_bench.json gpu-out/threshold_bench.json

Takes any mix of the JSON that bench/gpu_attention_bench.py, bench/gpu_decode_bench.py and
bench/gpu_threshold_bench.py write (recognized by their fields); a bar whose rows are in none of
them is reported as not measured, never as met. The issues ask for their bars in one run: give
the files of one run. Ratios are of TFLOP/s (higher is better) or, where the issue states a bar
in time, of milliseconds. Exit status 0 whether bars hold or not (1 for unreadable input), so the
table can end a GPU script; --strict exits 2 when a measured bar misses.
"""
import argparse
import json
import sys
from dataclasses import dataclass


@dataclass
class Bar:
    issue: int
    what: str
    shape: str
    measured: float | None
    bound: float
    at_least: bool  # the measured value must be >= bound (else <= bound)

    @property
    def margin(self):
        """How far the measurement clears the bound (negative: misses it), relative to the bound,
        as a fraction; a margin within a run's spread (1-2% here) says a repeat may fall either way."""
        if self.measured is None:
            return None
        return self.measured / self.bound - 1.0 if self.at_least else self.bound / self.measured - 1.0

    @property
    def status(self):
        if self.measured is None:
            return "not measured"
        ok = self.measured >= self.bound if self.at_least else self.measured <= self.bound
        return "met" if ok else "MISSED"


def kind_of(data):
    if "copy_gbps" in data and "lengths" in data:
        return "decode"
    if "zero_fractions" in data:
        return "threshold"
    if "results" in data:
        return "attention"
    raise ValueError("not the JSON of a known benchmark (attention, decode or threshold)")


class Rows:
    """The rows of one kind of benchmark, by (method, L, D)."""

    def __init__(self):
        self.rows = {}

    def add(self, results, path):
        for r in results:
            key = (r["method"], int(r["L"]), int(r["D"]))
            if key in self.rows:
                print(f"issue_bars: {key} is in more than one file; {path}'s is taken", file=sys.stderr)
            self.rows[key] = r

    def get(self, method, length, dim, field):
        row = self.rows.get((method, length, dim))
        return None if row is None or row.get(field) is None else float(row[field])

    def ratio(self, method, baseline, length, dim, field):
        x, y = self.get(method, length, dim, field), self.get(baseline, length, dim, field)
        return None if x is None or y is None or y == 0 else x / y


def attention_bars(rows):
    bars = []
    for length in (8192, 32768):
        shape = f"D 128, L {length}"
        bars.append(Bar(17, "softmax f+b TF/s x cuDNN", shape,
                        rows.ratio("winnow_softmax", "sdpa_cudnn", length, 128, "fwd_bwd_tflops"), 0.8, True))
        bars.append(Bar(17, "stick-breaking f+b TF/s x FA2", shape,
                        rows.ratio("winnow_stick_breaking", "sdpa_flash", length, 128, "fwd_bwd_tflops"), 1.0, True))
    bars.append(Bar(17, "stick-breaking forward TF/s x FA2", "D 64, L 8192",
                    rows.ratio("winnow_stick_breaking", "sdpa_flash", 8192, 64, "fwd_tflops"), 1.0, True))
    for length in (4096, 16384):
        shape = f"D 128, L {length}"
        for field, what in (("fwd_tflops", "forward"), ("fwd_bwd_tflops", "f+b")):
            bars.append(Bar(10, f"entmax-1.5 {what} TF/s x AdaSplash-2", shape,
                            rows.ratio("winnow_entmax15", "adasplash2_entmax15", length, 128, field), 1.5, True))
        bars.append(Bar(10, "Sieve (exact) f+b TF/s x FA2", shape,
                        rows.ratio("winnow_sieve_exact", "sdpa_flash", length, 128, "fwd_bwd_tflops"), 0.6, True))
        bars.append(Bar(10, "Sieve (bound) f+b TF/s x FA2", shape,
                        rows.ratio("winnow_sieve_bound", "sdpa_flash", length, 128, "fwd_bwd_tflops"), 0.75, True))
    return bars


def decode_bars(data):
    bars = []
    copy = data.get("copy_gbps")
    for length, bound in ((32768, 0.7), (4096, 0.5)):
        at = data["lengths"].get(str(length), {})
        for method in ("winnow softmax", "winnow stick-breaking"):
            gbps = at.get(method, {}).get("gbps")
            measured = gbps / copy if gbps is not None and copy else None
            bars.append(Bar(17, f"{method.split(' ', 1)[1]} decode x copy bandwidth", f"{length} keys", measured,
                            bound, True))
    return bars


def threshold_bars(rows):
    bars = []
    for length in (4096, 16384):
        shape = f"D 128, L {length}"
        bars.append(Bar(14, "TRA forward TF/s x FA2 (beta 0)", shape,
                        rows.ratio("winnow_tra", "sdpa_flash", length, 128, "fwd_tflops"), 1.2, True))
        bars.append(Bar(14, "TDA f+b time x FA2's (beta 0)", shape,
                        rows.ratio("winnow_tda", "sdpa_flash", length, 128, "fwd_bwd_ms"), 1.5, False))
        for variant in ("tra", "tda"):
            # The forward at beta 1 against beta 0: time at beta 0 over time at beta 1.
            speedup = rows.ratio(f"winnow_{variant}", f"winnow_{variant}_beta1", length, 128, "fwd_ms")
            bars.append(Bar(14, f"{variant.upper()} forward at beta 1 x beta 0", shape, speedup, 3.0, True))
            # The same with the int8 screen at beta 1 (WINNOW_THRESHOLD_SCREEN, opt-in: the default
            # forward above does not screen), against the default forward at beta 0.
            screened = rows.ratio(f"winnow_{variant}", f"winnow_{variant}_beta1_screen", length, 128, "fwd_ms")
            bars.append(Bar(14, f"{variant.upper()} fwd, beta 1 screened x beta 0", shape, screened, 3.0, True))
            # The same back to back (fwd_steady_ms: the host's dispatch hidden behind the calls
            # before, as in a model), beside the from-idle timing above, not instead of it.
            steady = rows.ratio(f"winnow_{variant}", f"winnow_{variant}_beta1_screen", length, 128, "fwd_steady_ms")
            bars.append(Bar(14, f"{variant.upper()} fwd, b1 screened x b0, steady", shape, steady, 3.0, True))
    return bars


def evaluate(paths):
    attention, threshold, decode = Rows(), Rows(), None
    devices = set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        kind = kind_of(data)
        devices.add(data.get("device", "?"))
        if kind == "attention":
            attention.add(data["results"], path)
        elif kind == "threshold":
            threshold.add(data["results"], path)
        else:
            decode = data
    bars = attention_bars(attention) + threshold_bars(threshold)
    bars += decode_bars(decode if decode is not None else {"lengths": {}})
    return sorted(bars, key=lambda b: b.issue), devices


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="benchmark JSON files of one run")
    parser.add_argument("--strict", action="store_true", help="exit 2 when a measured bar misses")
    args = parser.parse_args(argv)
    try:
        bars, devices = evaluate(args.json)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"issue_bars: {e}", file=sys.stderr)
        return 1
    print(f"device: {', '.join(sorted(devices))}")
    print(f"{'issue':>5}  {'bar':<42} {'shape':<16} {'measured':>9} {'bound':>7} {'margin':>7}  status")
    for b in bars:
        measured = "-" if b.measured is None else f"{b.measured:.3f}"
        bound = f"{'>=' if b.at_least else '<='}{b.bound:g}"
        margin = "-" if b.margin is None else f"{100 * b.margin:+.1f}%"
        print(f"{b.issue:>5}  {b.what:<42} {b.shape:<16} {measured:>9} {bound:>7} {margin:>7}  {b.status}")
    if any(b.margin is not None and abs(b.margin) < 0.02 for b in bars):
        print("(a margin under 2% is within a run's spread: a repeat may fall either way)")
    missed = any(b.status == "MISSED" for b in bars)
    return 2 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
