#!/usr/bin/env python3
"""Data-parallel scaling of a study (issue 18): the same study run on one GPU and on N, side by
side. For every mechanism in both results: the accuracy (or the study's measure) at each length,
and training throughput as the median tokens/s of the logged windows after the first (the first
holds start-up and the CUDA graph capture), from each run's metrics.jsonl.

    tools/ddp_compare.py runs/ddp-1 runs/ddp-2 [--share runs/ddp-share] [--json OUT]

--share: the study on one GPU with each rank's share of the batch (batch_size / N): N times its
tokens/s is what N GPUs reach with communication free, the bound the speed-up is measured
against beside the ideal N.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path


def load(study_dir: Path):
    result = json.loads((study_dir / "result.json").read_text())
    rows = {}
    for m in result["mechanisms"]:
        metrics = Path(m["config"]["train"]["out_dir"]) / "metrics.jsonl"
        rates = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if "tokens_per_s" in record and record.get("tokens_per_s", 0) > 0:
                    rates.append(record["tokens_per_s"])
        measure = result.get("metric", "accuracy")
        if result.get("generative"):
            measure = "exact_match"
        rows[m["label"]] = {
            "tokens_per_s_windows": rates,
            "tokens_per_s": statistics.median(rates[1:]) if len(rates) > 1 else (rates[0] if rates else None),
            "train_seconds": m["train_seconds"],
            "measure": measure,
            "by_length": {str(p["length"]): p[measure] for p in m["results"]},
            "exact_match_by_length": {str(p["length"]): p.get("exact_match") for p in m["results"]},
            "final_eval_loss": m["final_eval"].get("eval_loss"),
        }
    return result.get("data_parallel_ranks", 1), result.get("device"), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("one", type=Path, help="the study's out_dir from one GPU")
    ap.add_argument("many", type=Path, help="the study's out_dir from several GPUs")
    ap.add_argument("--share", type=Path, help="the study on one GPU with batch_size / N")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n1, device, a = load(args.one)
    n2, _, b = load(args.many)
    share = load(args.share)[2] if args.share else {}
    out = {"ranks": [n1, n2], "device": device, "mechanisms": {}}
    print(f"| mechanism | ranks | tokens/s (M) | speed-up | train s | final eval loss | {'measure by length' } |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label in a:
        if label not in b:
            continue
        x, y = a[label], b[label]
        speedup = y["tokens_per_s"] / x["tokens_per_s"] if x["tokens_per_s"] and y["tokens_per_s"] else None
        out["mechanisms"][label] = {"one": x, "many": y, "speedup": speedup}
        if label in share and share[label]["tokens_per_s"] and x["tokens_per_s"]:
            bound = n2 * share[label]["tokens_per_s"]
            out["mechanisms"][label]["share"] = share[label]
            out["mechanisms"][label]["bound_speedup"] = bound / x["tokens_per_s"]
            out["mechanisms"][label]["fraction_of_bound"] = y["tokens_per_s"] / bound if y["tokens_per_s"] else None
        for ranks, r in ((n1, x), (n2, y)):
            lengths = ", ".join(f"{k}: {100 * v:.1f}%" for k, v in r["by_length"].items())
            tps = f"{r['tokens_per_s'] / 1e6:.2f}" if r["tokens_per_s"] else "-"
            su = f"{speedup:.2f}x" if (speedup and r is y) else ""
            loss = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
            print(f"| {label} | {ranks} | {tps} | {su} | {r['train_seconds']:.1f} | {loss} | {lengths} |")
    for label, m in out["mechanisms"].items():
        if "bound_speedup" in m:
            print(f"\n{label}: one device with a rank's share of the batch runs at "
                  f"{m['share']['tokens_per_s'] / 1e6:.2f} M tokens/s, so {n2} devices with free communication "
                  f"would reach {m['bound_speedup']:.2f}x; measured {m['speedup']:.2f}x "
                  f"({100 * m['fraction_of_bound']:.0f}% of that bound)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
