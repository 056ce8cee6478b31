#!/usr/bin/env bash
# Checks every CUDA unit of a configured build through nvcc's front end only (-cuda in place of
# -c): a template that does not instantiate for some policy fails here in 20-60 s a unit, where
# a full build spends minutes in ptxas first (a GPU call lost to one such error in session 88).
# Usage, on a machine without a GPU (the build configured with ninja, e.g. WINNOW_TORCH=OFF):
#   tools/check_cuda_units.sh BUILD_DIR [JOBS]
# Prints a line per unit and exits nonzero if any fails; the units' messages go to
# $TMPDIR/winnow-units/UNIT.log.
set -uo pipefail
build=${1:?usage: tools/check_cuda_units.sh BUILD_DIR [JOBS]}
jobs=${2:-$(nproc)}
logs=${TMPDIR:-/tmp}/winnow-units
mkdir -p "$logs"
cd "$build" || exit 1
mapfile -t units < <(ninja -t targets all | grep -o '^[^:]*\.cu\.o' | sort -u)
(( ${#units[@]} > 0 )) || { echo "no CUDA units in $build"; exit 1; }
for unit in "${units[@]}"; do
  name=$(basename "$unit" .cu.o)
  # The unit's compile line, writing the front end's output to the log folder instead of the
  # object (and no dependency file, so that ninja's own stays as it was).
  ninja -t commands "$unit" | tail -1 |
    sed -E "s# -MD -MT [^ ]+ -MF [^ ]+##; s# -o [^ ]+\.cu\.o# -o $logs/$name.ii#; s# -c # -cuda #" \
      > "$logs/$name.sh"
done
printf '%s\n' "${units[@]}" | xargs -P "$jobs" -I{} bash -c '
  name=$(basename {} .cu.o)
  if bash "$0/$name.sh" > "$0/$name.log" 2>&1; then echo "ok     $name"; else echo "FAILED $name ($0/$name.log)"; fi
' "$logs" | sort -k2 | tee "$logs/summary.txt"
rm -f "$logs"/*.ii
! grep -q '^FAILED' "$logs/summary.txt"
