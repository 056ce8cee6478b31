#!/usr/bin/env bash
# A parked patch against main in one build tree, on the GPU machine:
#
#   tools/parked_ab.sh docs/parked/NAME.patch -- python3 bench/gpu_attention_bench.py --dims 128
#
# Builds main (tools/gpu_check.sh build; $BUILD_TARGETS, default winnow_torch), then for each of
# $AB_ROUNDS rounds (default 2) runs the command on main and on the patched tree, in that order,
# so that a drift of the machine shows as a difference between rounds rather than between the
# two trees. Each switch is `git apply` (or -R) and a touch of the files the patch names, then
# an incremental build; ccache makes every switch after the first two hits. The command gets
# $AB_TREE (main or patch) in its environment, and every argument @AB_JSON@ in it becomes a
# path under $OUT for its JSON (`--json @AB_JSON@` is appended when the command names a
# bench/gpu_*_bench.py script and no --json). For environment settings, `env VAR=x command`.
# $AB_BUILD replaces the build command (default: tools/gpu_check.sh build).
# Outputs: $OUT/ab-<tree>-<round>.{txt,json} and $OUT/ab-summary.txt, the lines of every run
# matching $AB_GREP (default: the benches' table rows), grouped by tree.
# The tree is left patched (for tests on the patched build: `$BUILD/tests/winnow_cuda_tests`),
# unless $AB_END=main. $DEADLINE (seconds): no run starts after it; the summary says so.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
patch=${1:?usage: tools/parked_ab.sh PATCH -- COMMAND...}
shift
[[ "${1:-}" == "--" ]] && shift
(( $# > 0 )) || { echo "parked_ab: no command after the patch" >&2; exit 2; }
[[ -f "$patch" ]] || { echo "parked_ab: no patch at '$patch'" >&2; exit 2; }
OUT=${OUT:-$PWD/gpu-out}
BUILD=${BUILD:-build-gpu}
export BUILD
mkdir -p "$OUT"
rounds=${AB_ROUNDS:-2}
start=$(date +%s)
summary="$OUT/ab-summary.txt"
: > "$summary"

files=$(git apply --numstat "$patch" | awk '{print $3}')
tree=main
if git apply --check -R "$patch" 2> /dev/null; then
  echo "parked_ab: the tree already carries the patch; taking it back first"
  git apply -R "$patch" || exit 3
fi
git apply --check "$patch" || { echo "parked_ab: '$patch' does not apply to this tree" >&2; exit 3; }

build() {
  # A fresh copy of the working tree keeps older modification times than the build's objects:
  # touch what the patch changes so that the build sees every switch.
  local f t0
  for f in $files; do [[ -e "$f" ]] && touch "$f"; done
  t0=$(date +%s)
  if ! OUT="$OUT/build-$tree" BUILD_TARGETS="${BUILD_TARGETS:-winnow_torch}" \
      bash -c "${AB_BUILD:-tools/gpu_check.sh build}" > "$OUT/build-$tree.txt" 2>&1; then
    tail -20 "$OUT/build-$tree.txt"
    echo "parked_ab: build of $tree FAILED" | tee -a "$summary"
    exit 4
  fi
  echo "build $tree: $(( $(date +%s) - t0 )) s" | tee -a "$summary"
}
switch_to() {
  [[ "$tree" == "$1" ]] && return
  if [[ "$1" == patch ]]; then git apply "$patch"; else git apply -R "$patch"; fi || exit 3
  tree=$1
  build
}

build
command=("$@")
if [[ " $* " == *" bench/gpu_"*"_bench.py "* && " $* " != *" --json "* ]]; then
  command+=(--json @AB_JSON@)
fi
export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
# Baseline wheels carried in .whl/ (AdaSplash-2), as tools/gpu_check.sh's bench installs them, so
# that an A/B's bench measures them beside both trees.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$BUILD/site" .whl/*.whl \
    && export PYTHONPATH="$PWD/$BUILD/site${PYTHONPATH:+:$PYTHONPATH}"
fi
for (( r = 1; r <= rounds; ++r )); do
  for t in main patch; do
    if [[ -n "${DEADLINE:-}" ]] && (( $(date +%s) - start > DEADLINE )); then
      echo "round $r $t: not run (past DEADLINE=$DEADLINE s)" | tee -a "$summary"
      continue
    fi
    switch_to "$t"
    export AB_TREE=$t
    run=("${command[@]//@AB_JSON@/$OUT/ab-$t-$r.json}")
    t0=$(date +%s)
    "${run[@]}" > "$OUT/ab-$t-$r.txt" 2>&1
    echo "round $r $t: rc $? ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  done
done
[[ "${AB_END:-patch}" == main ]] && switch_to main

pattern=${AB_GREP:-'^ *[0-9]+ +(sdpa|winnow|composed|adasplash|triton|paper)'}
for t in main patch; do
  for (( r = 1; r <= rounds; ++r )); do
    [[ -f "$OUT/ab-$t-$r.txt" ]] || continue
    echo "-- $t, round $r"
    grep -E "$pattern" "$OUT/ab-$t-$r.txt"
  done
done >> "$summary"
echo "== parked_ab: $(( $(date +%s) - start )) s; the tree is left on $tree"
cat "$summary"
