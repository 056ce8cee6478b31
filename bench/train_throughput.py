"""Training throughput of the model layer: tokens per second of `winnow train` for each
attention layer kind, with the fused operators and with the composed LibTorch expressions,
at two sequence lengths. A 2-layer d = 256 model, bf16 autocast on CUDA (fp32 on the CPU).

    python3 bench/train_throughput.py --winnow build-gpu/apps/winnow --json out.json
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

KINDS = {
    "softmax_rope": [],
    "softmax_nope": ["model.attention.position=nope"],
    "softmax_alibi": ["model.attention.position=alibi"],
    "ssmax_gated": ["model.attention.ssmax=true", "model.attention.gate=g1g2"],
    "differential": ["model.attention.kind=differential"],
    "stick_breaking": ["model.attention.kind=stick_breaking", "model.attention.position=nope"],
}
COMPOSED_TOO = {"softmax_rope", "stick_breaking"}


def run(winnow, config, overrides, steps, log_every):
    with tempfile.TemporaryDirectory() as out:
        cmd = [winnow, "train", "--config", config, "--fresh",
               "--set", f"train.out_dir={out}", "--set", f"train.steps={steps}",
               "--set", f"train.log_every={log_every}", "--set", "train.eval_every=0"]
        for o in overrides:
            cmd += ["--set", o]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip()[-300:]}
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if '"tokens_per_s"' in line]
        rates = [r["tokens_per_s"] for r in rows[1:]]  # the first window includes start-up
        return {"tokens_per_s": statistics.median(rates), "final_loss": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--winnow", default="build/apps/winnow")
    ap.add_argument("--config", default="configs/progression.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [(64, 64), (1024, 16)]  # (sequence length, batch size)
    results = []
    for L, batch in shapes:
        common = [f"train.seq_len={L}", f"train.batch_size={batch}", f"model.max_len={L}",
                  "train.warmup=0"]
        for kind, overrides in KINDS.items():
            for impl in (["kernel", "composed"] if kind in COMPOSED_TOO else ["kernel"]):
                r = run(args.winnow, args.config,
                        common + overrides + [f"model.attention.implementation={impl}"],
                        args.steps, args.steps // 4)
                r.update({"L": L, "batch": batch, "kind": kind, "implementation": impl})
                results.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'L':>5} {'kind':<16} {'impl':<9} {'tokens/s':>10} {'speedup':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['L']:>5} {r['kind']:<16} {r['implementation']:<9} error: {r['error'][:80]}")
            continue
        base = next((x for x in results if x["L"] == r["L"] and x["kind"] == r["kind"]
                     and x["implementation"] == "composed" and "error" not in x), None)
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{r['L']:>5} {r['kind']:<16} {r['implementation']:<9} {r['tokens_per_s']:10.0f} {speed:8.2f}")


if __name__ == "__main__":
    main()
