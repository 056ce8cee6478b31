#!/usr/bin/env bash
# The parked patches' measurement on the GPU machine:
#
#   tools/gpu_detached.sh start docs/parked/measure.sh     # then tools/gpu_detached.sh poll
#
# 1. one of three ways to get a patched build:
#    - $PATCHES (patch names, in stacking order): an A/B of each against the
#      tree with the ones before it (tools/parked_ab.sh, two rounds, one build tree), with the
#      bench that shows its rows;
#    - $COMBINED (patch names, or a patch file holding them all): one A/B instead (see there);
#    - $APPLY (patch names): applied and built, no A/B, for a patch measured already (then
#      only the patches named in $PATCHES get an A/B, on top of them);
# 2. the whole C++ CUDA suite on the Hopper and the portable kernels (eight shards each);
# 3. compute-sanitizer racecheck and memcheck over the small, backward and tile-skipping tests
#    (racecheck without the one decoding test it cannot finish in time; see there);
# 4. the Python operators' CUDA tests, where winnow_torch was built (PYCUDA=0 skips them);
# 5. with $STUDIES set (see there), rows of study files, one at a time, checkpoints chosen at 8x;
# 6. with $AFTER set, that command line.
# Everything goes to $RESULTS (tools/gpu_detached.sh); progress.txt ends with the stick-breaking
# and Sieve rows of every benchmark run, the table to read first. Measured on 2026-11-29: the
# cold build 7.5 minutes, a rebuild after a patch to the attention kernels 4, each round of the
# benches 1-2, the suite 4, the sanitizers 1, the 16-head 20M Sieve row 2.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
R=${RESULTS:-/tmp/winnow-results}
P=$R/progress.txt
mkdir -p "$R"
START=$(date +%s)
say() { echo "[$(( $(date +%s) - START )) s] $*" >> "$P"; }
# The test a gtest log (not --gtest_brief) last started: where a run cut off by its limit was.
last_started() { grep -E '^\[ RUN      \]' "$1" | tail -1 | sed 's/^\[ RUN      \] //'; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader >> "$P" 2>&1
export BUILD_TARGETS=${BUILD_TARGETS:-"winnow_cuda_tests winnow_torch winnow_cli"}
BENCH=(python3 bench/gpu_attention_bench.py --tokens 32768 --heads 16 --lengths 8192 32768 --dims 128 64
       --methods sdpa_flash sdpa_cudnn winnow_softmax winnow_stick_breaking)

SMALL_BENCH=(python3 bench/gpu_attention_bench.py --tokens 32768 --heads 16 --lengths 1024 4096 --dims 16 32
             --methods sdpa_flash sdpa_cudnn winnow_stick_breaking winnow_sieve_bound)

SCREEN_BENCH=(python3 bench/gpu_threshold_bench.py --methods sdpa_flash winnow_tra winnow_tda winnow_tra_beta1_screen
              winnow_tda_beta1_screen winnow_tra_screen winnow_tda_screen)

# A patch to entmax's or Sieve's kernels (issue 10's shapes): their rows beside SDPA flash and,
# when its wheel was carried (.whl/), AdaSplash-2. AdaSplash-2's Triton kernels compile in the
# first round (280 s of 323 on 2026-11-30); AB_ADASPLASH=0 leaves them out of the A/Bs, which
# compare winnow's trees, when GPU time is short.
ENTMAX_BENCH=(python3 bench/gpu_attention_bench.py --tokens 16384 --heads 12 --lengths 4096 16384 --dims 128
              --methods sdpa_flash winnow_entmax15 adasplash2_entmax15 winnow_sieve_exact winnow_sieve_bound)
if [[ ${AB_ADASPLASH:-1} == 0 ]]; then
  kept=()
  for word in "${ENTMAX_BENCH[@]}"; do [[ $word == adasplash2_entmax15 ]] || kept+=("$word"); done
  ENTMAX_BENCH=("${kept[@]}")
fi

# A patch to threshold attention's other kernels: the beta-0 rows beside softmax's.
THRESHOLD_BENCH=(python3 bench/gpu_threshold_bench.py --methods sdpa_flash winnow_softmax winnow_tra winnow_tda)


# $COMBINED: parked patch names (stacked in that order; measure.sh makes the combined patch) or
# a patch file holding them all: one A/B instead of one per patch, running $COMBINED_COMMAND
# (default: COMBINED_BENCH and the threshold bench, the rows the patches parked now touch). It
# saves a rebuild and four bench runs per patch: on 2026-11-29 it let four patches fit one
# session. A row then names the patches that touch it, so patches whose rows overlap are
# measured together (2026-11-29, last: the chains touch only the D = 64 stick-breaking forward,
# which the descriptor patch touches too; its other rows are the descriptors' alone).
COMBINED_BENCH=(python3 bench/gpu_attention_bench.py --tokens 32768 --heads 16 --lengths 4096 8192 16384
                --dims 64 128 --methods sdpa_flash winnow_stick_breaking winnow_entmax15 winnow_sieve_bound)
if [[ -n "${COMBINED:-}" ]]; then
  combined=$COMBINED
  if [[ ! -f $combined ]]; then
    for patch in $COMBINED; do
      git apply "docs/parked/$patch.patch" || { say "$patch does not apply; stopping"; exit 1; }
    done
    combined=$R/combined.patch
    git diff > "$combined"
    git diff --name-only | xargs git checkout --
  fi
  say "A/B of $COMBINED, combined"
  j='@AB_JSON@'
  command=${COMBINED_COMMAND:-"${COMBINED_BENCH[*]} --json $j; python3 bench/gpu_threshold_bench.py --methods winnow_tra winnow_tda winnow_tra_beta1 winnow_tda_beta1 --json $j.threshold.json"}
  OUT=$R/ab-combined tools/parked_ab.sh "$combined" -- bash -c "$command" > "$R/ab-combined.txt" 2>&1
  say "A/B combined: rc $?"
  grep -E '^build|^round|FAILED' "$R/ab-combined/ab-summary.txt" >> "$P" 2>&1
  PATCHES=none
fi

if [[ -n "${APPLY:-}" ]]; then
  for patch in $APPLY; do
    git apply "docs/parked/$patch.patch" && say "applied $patch" || say "$patch does not apply"
  done
  say "build: $(OUT=$R/build bash -c "${AB_BUILD:-tools/gpu_check.sh build}" > "$R/build.txt" 2>&1 && echo ok || echo FAILED, see build.txt)"
  # A/Bs only of the patches named in $PATCHES, on top of these.
  PATCHES=${PATCHES:-none}
fi

# Nothing to apply or compare ($COMBINED, $APPLY and $PATCHES unset): the tree as it is, built.
if [[ -z "${COMBINED:-}${APPLY:-}" && ${PATCHES:-none} == none ]]; then
  say "build: $(OUT=$R/build bash -c "${AB_BUILD:-tools/gpu_check.sh build}" > "$R/build.txt" 2>&1 && echo ok || echo FAILED, see build.txt)"
fi

# $PATCHES: which of them, in this order (each stacks on the ones before it); none by default.
for patch in ${PATCHES:-none}; do
  [[ $patch == none ]] && break
  bench=("${BENCH[@]}")
  # A patch for head dimensions 16 and 32 shows in these rows instead.
  [[ $patch == small-dims-* ]] && bench=("${SMALL_BENCH[@]}")
  # A patch to threshold attention's int8 screen: the screened rows at beta 1 and 0.
  [[ $patch == screen-* ]] && bench=("${SCREEN_BENCH[@]}")
  [[ $patch == threshold-* ]] && bench=("${THRESHOLD_BENCH[@]}")
  # Entmax's and Sieve's: their rows, then their kernels' times (the bench's rows move by 1-2%
  # between rounds, more than a change to one of their three sweeps shows).
  [[ $patch == entmax-* || $patch == sieve-* ]] &&
    bench=(bash -c "${ENTMAX_BENCH[*]} --json @AB_JSON@; python3 bench/kernel_breakdown.py --lengths 4096 16384 \
                    --methods winnow_entmax15 winnow_sieve_exact --calls 3 > @AB_JSON@.kernels.txt 2>&1")
  say "A/B $patch"
  OUT=$R/ab-$patch tools/parked_ab.sh "docs/parked/$patch.patch" -- "${bench[@]}" > "$R/ab-$patch.txt" 2>&1
  say "A/B $patch: rc $?"
  grep -E '^build|^round|FAILED' "$R/ab-$patch/ab-summary.txt" >> "$P" 2>&1
  # parked_ab leaves the tree patched, which the next patch stacks on.
done

T=build-gpu/tests/winnow_cuda_tests
if [[ ! -x $T ]]; then
  say "no $T: the builds failed; see $R/ab-*/build-*.txt"
else
  # $SUITE_FILTER: a gtest filter for the suite (default: every test), for a change whose tests
  # are known; $SANITIZE_FILTER and $SANITIZE_SECONDS likewise for the sanitizers; $SUITE_KERNELS
  # (default "hopper portable") for a change to one kernel set only.
  for kernels in ${SUITE_KERNELS:-hopper portable}; do
    for i in 0 1 2 3 4 5 6 7; do
      if [[ $kernels == portable ]]; then export WINNOW_PORTABLE_KERNELS=1; else unset WINNOW_PORTABLE_KERNELS; fi
      # Without --gtest_brief each test's start is written (and flushed) as it begins, so a shard
      # cut off by the time limit still says which test it hung in (2026-11-29: every Hopper shard
      # hung on the first tensor-copy backward and, brief, left empty logs).
      GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 400 $T --gtest_filter="${SUITE_FILTER:-*}" \
        > "$R/suite-$kernels-$i.log" 2>&1 &
    done
    wait
    unset WINNOW_PORTABLE_KERNELS
    ran=$(cat "$R"/suite-$kernels-*.log | grep -E '^\[==========\] [0-9]+ tests' | awk '{s += $2} END {print s + 0}')
    passed=$(cat "$R"/suite-$kernels-*.log | grep -E '^\[  PASSED  \]' | awk '{s += $4} END {print s + 0}')
    say "suite, $kernels kernels: $passed of $ran passed; failures: $(grep -hE '^\[  FAILED  \] [A-Za-z]' "$R"/suite-$kernels-*.log | sed 's/, where GetParam.*//' | sort -u | head -8 | tr '\n' ' ')"
    for f in "$R"/suite-$kernels-*.log; do
      grep -qE '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$f" ||
        say "  $(basename "$f" .log) cut off in: $(last_started "$f")"
    done
  done
  F=${SANITIZE_FILTER:-'CudaSmall.*:CudaBackward.*:CudaTileSkipping.*:CudaDeterminism.*:CudaSmallDecode.*:CudaContiguousDecode.*:Cuda/CudaPagedDecode.*'}
  # The sanitizers' logs keep each test's name (no --gtest_brief), so that a run cut off by its
  # time limit says which test it was in ($SANITIZE_SHARDS: more shards, less to cut off).
  shards=${SANITIZE_SHARDS:-4}
  # Under racecheck the decoding test of Sieve and entmax runs past the time limit (its shard was
  # cut off in it in sessions 73 and 75, leaving the shard's later tests unchecked): memcheck
  # runs it, racecheck the others ($RACECHECK_FILTER to choose).
  slow=CudaContiguousDecode.SieveAndEntmaxDecodeBehindTheirSearch
  if [[ $F == *-* ]]; then RF=${RACECHECK_FILTER:-"$F:$slow"}; else RF=${RACECHECK_FILTER:-"$F-$slow"}; fi
  say "racecheck filter: $RF"
  for (( i = 0; i < shards; ++i )); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${SANITIZE_SECONDS:-500}" compute-sanitizer --tool racecheck --error-exitcode 9 \
      $T --gtest_filter="$RF" > "$R/racecheck-$i.log" 2>&1 &
  done
  timeout "${SANITIZE_SECONDS:-500}" compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_filter="$F" \
    > "$R/memcheck.log" 2>&1 &
  wait
  for f in "$R"/racecheck-*.log "$R"/memcheck.log; do
    say "$(basename "$f" .log): $(grep -hE 'RACECHECK SUMMARY|ERROR SUMMARY|PASSED|tests ran' "$f" | tr '\n' ' ')"
    # A shard the filter left no test sends no CUDA call, so the sanitizer writes no summary.
    if grep -qE '^\[==========\] Running 0 tests' "$f"; then
      say "  no test in this shard"
    elif ! grep -qE 'RACECHECK SUMMARY|ERROR SUMMARY' "$f"; then
      say "  cut off by the time limit in: $(last_started "$f")"
    fi
  done
fi

# The Python operators on CUDA (tests/python_cuda), where the operator library was built;
# PYCUDA=0 skips them.
if [[ "${PYCUDA:-1}" != 0 && -f build-gpu/libwinnow_torch.so ]]; then
  WINNOW_LIBRARY="$PWD/build-gpu/libwinnow_torch.so" PYTHONPATH="$PWD/python:$PWD/tests/python" \
    timeout 600 python3 -m pytest -q -p no:cacheprovider tests/python_cuda > "$R/pycuda.log" 2>&1
  say "pycuda: rc $?, $(tail -1 "$R/pycuda.log"); $(grep -E '^(FAILED|ERROR)' "$R/pycuda.log" | head -5 | tr '\n' ' ')"
fi

# STUDIES: "FILE=REGEX" pairs separated by ';', e.g.
#   STUDIES='studies/mqrar_sieve.json=16 heads, 20M;studies/copy_protocol.json=^(Stick-breaking, 4 heads|Sieve \(bound\), 16 heads)$'
if [[ -n "${STUDIES:-}" && -x build-gpu/apps/winnow ]]; then
  IFS=';' read -ra pairs <<< "$STUDIES"
  for pair in "${pairs[@]}"; do
    file=${pair%%=*} pattern=${pair#*=}
    mapfile -t rows < <(python3 -c "import json,re,sys; [print(m['label']) for m in json.load(open(sys.argv[1]))['mechanisms'] if re.search(sys.argv[2], m['label'])]" "$file" "$pattern")
    (( ${#rows[@]} > 0 )) || say "study $file: no row matches '$pattern'"
    for row in "${rows[@]}"; do
      say "study $file, row: $row"
      dir=$R/study-$(basename "$file" .json)-$(echo "$row" | tr -c 'A-Za-z0-9\n' '_')
      build-gpu/apps/winnow study "$file" --only "$row" --set eval.select_multiple=8 --set out_dir="$dir" > "$dir.log" 2>&1
      say "  rc $?: $(grep -F "| $row |" "$dir.log" | head -2 | tr '\n' ' ')"
    done
  done
fi

# $AFTER: a command line run last, on the same build (profiles, benchmarks with baselines),
# its output in after.txt; e.g.
#   AFTER='OUT=$R tools/ncu_summary.sh fwd64 attention_forward -- python3 tools/profile_attention.py ...'
if [[ -n "${AFTER:-}" ]]; then
  # The benches find the operator library through this (tools/gpu_check.sh sets it for its own).
  export WINNOW_LIBRARY=${WINNOW_LIBRARY:-$PWD/build-gpu/libwinnow_torch.so}
  say "after: $AFTER"
  R=$R bash -c "$AFTER" > "$R/after.txt" 2>&1
  say "after: rc $?"
fi

{
  echo "== the benches' rows (D, L, method, fwd, x flash, fwd inference, bwd, x flash, f+b, x flash, ...;"
  echo "   threshold attention: L, method, fwd ms, fwd TF/s, x flash's time, f+b ms, ...)"
  for f in "$R"/ab-*/ab-*-[12].txt "$R"/after.txt; do
    [[ -f $f ]] || continue
    echo "-- $f"
    grep -E '^ *([0-9]+ +)?[0-9]+ +(sdpa_|winnow_|paper_|adasplash|sb_paper)' "$f"
    # the decode bench's table (bench/gpu_decode_bench.py), when the command ran it
    grep -E '^(copy bandwidth|method +L=|winnow (softmax|stick|sieve|entmax|tra|tda)|sdpa (flash|cudnn)|fused )' "$f"
  done
} >> "$P"
# The open issues' bars on the last patched round's JSON (tools/issue_bars.py).
last=$(ls "$R"/ab-*/ab-patch-2*.json 2> /dev/null)
[[ -n "$last" ]] && python3 tools/issue_bars.py $last 2>&1 | grep -v "not measured" >> "$P"
say "measure.sh done"
