#!/usr/bin/env bash
# The parked screen patches' A/Bs (docs/parked/screen_patches.sh, its variables), then Nsight
# Compute on kernels of the screened forward at beta 1 (NCU_KERNELS: regexes, one profile each,
# of the TRA call at L = 16384 in tools/profile_attention.py), in one detached run on the GPU
# machine:
#
#   PATCHES='...' NCU_KERNELS='threshold_screen_sm90 normalize_quantize_key_tiles' \
#   tools/gpu_detached.sh start docs/parked/ab_then_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
mkdir -p "$R"
if [[ -n ${PATCHES:-} ]]; then
  RESULTS=$R docs/parked/screen_patches.sh
else
  OUT=$R/build timeout 600 tools/gpu_check.sh build > "$R/build.txt" 2>&1
  echo "[build] rc $?" >> "$R/progress.txt"
fi
for kernel in ${NCU_KERNELS:-}; do
  WINNOW_THRESHOLD_SCREEN=1 OUT=$R NCU_NAME_BASE=function timeout "${NCU_SECONDS:-150}" tools/ncu_summary.sh \
    "ncu-$kernel" "$kernel" -- python3 tools/profile_attention.py --mechanism "${NCU_MECHANISM:-tra}" --beta 1 \
    --length 16384 > "$R/ncu-$kernel.txt" 2>&1
  echo "[ncu $kernel] rc $?" >> "$R/progress.txt"
  rm -f "$R"/*.ncu-rep "$R"/*.sass.csv "$R"/*.raw.csv
done
