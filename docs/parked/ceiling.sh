#!/usr/bin/env bash
# Issue 14's beta = 1 bar against what the hardware allows, in one detached run on the GPU
# machine (tools/gpu_detached.sh start docs/parked/ceiling.sh; carry .gpudeps):
# 1. bench/screen_ceiling.py: the smallest exact screen (int8 Q K^T and a row test, in Triton,
#    tuned), the same in bf16, the machine's int8 / bf16 matrix rates and copy rate;
# 2. builds winnow_torch and runs bench/gpu_threshold_bench.py (beta 0, beta 1, screened) and
#    tools/issue_bars.py on it;
# 3. bench/kernel_breakdown.py on the screened forwards (winnow's screen kernel beside the
#    minimal one);
# 4. screen_ceiling.py's budget: the bar's time against the minimal screen.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
mkdir -p "$R"
say() { echo "[$SECONDS s] $*" >> "$R/progress.txt"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader >> "$R/progress.txt" 2>&1
timeout "${CEILING_SECONDS:-420}" python3 bench/screen_ceiling.py --json "$R/ceiling.json" > "$R/ceiling.txt" 2>&1
say "screen_ceiling: rc $?"
BUILD_TARGETS=winnow_torch OUT=$R timeout 400 tools/gpu_check.sh build > "$R/build.log" 2>&1
say "build: rc $?"
export WINNOW_LIBRARY=$PWD/build-gpu/libwinnow_torch.so
timeout 400 python3 bench/gpu_threshold_bench.py --methods winnow_tra winnow_tra_beta1 winnow_tda winnow_tda_beta1 \
  winnow_tra_beta1_screen winnow_tda_beta1_screen --json "$R/bench.json" > "$R/bench.txt" 2>&1
say "bench: rc $?"
python3 tools/issue_bars.py "$R/bench.json" >> "$R/bench.txt" 2>&1
timeout 300 python3 bench/kernel_breakdown.py --lengths 4096 16384 --methods winnow_tra_beta1_screen \
  winnow_tda_beta1_screen --phases forward --calls 5 > "$R/breakdown.txt" 2>&1
say "breakdown: rc $?"
python3 bench/screen_ceiling.py --from-json "$R/ceiling.json" --bench-json "$R/bench.json" \
  --json "$R/ceiling-bar.json" > "$R/bar.txt" 2>&1
say "bar: rc $?"
cat "$R/ceiling.txt" "$R/bar.txt" >> "$R/progress.txt"
