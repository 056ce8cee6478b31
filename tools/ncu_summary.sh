#!/usr/bin/env bash
# Profiles one winnow kernel with Nsight Compute and prints what matters for tuning it: speed
# of light, warp stall reasons, pipe utilisation, and the SASS lines with the most stall
# samples. Usage (GPU machine, after tools/gpu_check.sh build):
#   tools/ncu_summary.sh NAME KERNEL_REGEX -- python3 tools/profile_attention.py ARGS...
set -uo pipefail
name=$1 kernel=$2; shift 2; [[ "$1" == "--" ]] && shift
OUT=${OUT:-$PWD/gpu-out}
export WINNOW_LIBRARY=${WINNOW_LIBRARY:-$PWD/${BUILD:-build-gpu}/libwinnow_torch.so}
ncu --kernel-name-base "${NCU_NAME_BASE:-function}" --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 --set full \
    --import-source no -f -o "$OUT/$name" "$@" > "$OUT/$name.ncu.log" 2>&1 || { tail -20 "$OUT/$name.ncu.log"; exit 1; }
ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name.details.txt" 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|L2 Cache Throughput|L1/TEX Cache Throughput|Mem Busy|Max Bandwidth|DRAM Throughput|Bank Conflicts|Shared Memory Configuration Size" "$OUT/$name.details.txt" | head -40
# Stall reasons (warp state) and the hottest SASS lines.
ncu -i "$OUT/$name.ncu-rep" --page raw --csv --metrics \
  regex:smsp__pcsamp_warps_issue_stalled_.*,regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
  > "$OUT/$name.raw.csv" 2>&1
python3 - "$OUT/$name.raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr, units, vals = rows[0], rows[1], rows[2] if len(rows) > 2 else []
pairs = []
for h, v in zip(hdr, vals):
    try: pairs.append((h, float(v.replace(',', ''))))
    except ValueError: pass
stalls = sorted([(v, h) for h, v in pairs if 'pcsamp_warps_issue_stalled' in h and not h.endswith('not_issued')], reverse=True)
tot = sum(v for v, _ in stalls) or 1
print("stall samples:", ", ".join(f"{h.split('stalled_')[1]} {100*v/tot:.0f}%" for v, h in stalls[:10]))
pipes = sorted([(v, h) for h, v in pairs if h.startswith('sm__pipe_')], reverse=True)
print("pipes % active:", ", ".join(f"{h[9:].split('_cycles')[0]} {v:.0f}" for v, h in pipes[:10]))
PY
ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>/dev/null
python3 - "$OUT/$name.sass.csv" <<'PY'
import csv, sys
try:
    rows = list(csv.reader(open(sys.argv[1])))
except Exception as e:
    print("no source page:", e); sys.exit()
# The page starts with the kernel's name on a line of its own, then the header.
while rows and rows[0] and rows[0][0] == "Kernel Name":
    rows = rows[1:]
if not rows: sys.exit()
hdr = rows[0]
def col(name):
    for i, h in enumerate(hdr):
        if h.startswith(name): return i
    return None
ci, cs, ce = col("Source"), col("Warp Stall Sampling (All Samples)"), col("Instructions Executed")
if cs is None: print("columns:", hdr[:20]); sys.exit()
data = []
for r in rows[1:]:
    try: data.append((float((r[cs] or "0").replace(",", "")), r[ci], r[ce] if ce is not None else ""))
    except (ValueError, IndexError): pass
tot = sum(d[0] for d in data) or 1
print("hottest SASS (share of stall samples):")
for s, src, ex in sorted(data, reverse=True)[:25]:
    print(f"  {100*s/tot:5.1f}%  {src.strip()[:90]}")
# The dynamic mix: warp instructions executed, summed by opcode (predicate and modifiers
# dropped), so that a change's effect on the instructions actually run can be told from its
# effect on the static count.
mix, stalls = {}, {}
for s, src, ex in data:
    words = [w for w in src.split() if not w.startswith("@")]
    if not words: continue
    op = words[0].split(".")[0]
    try: mix[op] = mix.get(op, 0) + float(ex.replace(",", "") or 0)
    except ValueError: pass
    stalls[op] = stalls.get(op, 0) + s
total = sum(mix.values()) or 1
print(f"warp instructions executed: {total:.4g}; by opcode (share; share of stall samples):")
print("  " + ", ".join(f"{op} {100*n/total:.1f}% ({100*stalls.get(op, 0)/tot:.0f}%)"
                      for op, n in sorted(mix.items(), key=lambda kv: -kv[1])[:24]))
PY
