#!/usr/bin/env bash
# The GPU workflow, run from the repository root on a machine with a GPU and a CUDA build of
# PyTorch (python3). Stages, in order (default: all):
#   build      configure against that torch's LibTorch (Hopper, sm_90a), build with all cores
#              ($BUILD_TARGETS: only these targets)
#   test       CUDA tests (label cuda: C++ kernels vs the float64 reference, Python operators),
#              the C++ CUDA tests again with the portable (sm_80) kernels forced on the Hopper
#              machine, then the CPU tests against this LibTorch
#   cudatest   only the CUDA tests, both kernel sets
#   pycuda     only the Python CUDA tests (tests/python_cuda) against the build's library
#   portable   only the C++ CUDA tests with the portable (sm_80) kernels forced
#   sanitize   compute-sanitizer memcheck and racecheck on the small CUDA tests, the direct
#              key-gradient backward, the tile-skipping and sparse-backward ones and the
#              element-wise kernels (rotary, RMSNorm, SwiGLU); memcheck over the model
#              layer's CUDA tests
#   bench      bench/gpu_attention_bench.py (SDPA flash and cuDNN, the paper's Triton kernel
#              when $BASELINES has stickbreaking_attention/, AdaSplash-2 when .whl/ has its
#              wheel, winnow)
#   tbench     bench/gpu_threshold_bench.py (threshold attention beside SDPA, and 004's Triton
#              kernels when $BASELINES has snap-research/TDA's triton_threshold_attention.py)
#   gbench     bench/gpu_gsa_bench.py (GSA's selection and sparse attention beside SDPA flash and
#              cuDNN at 16K-128K, issue 16; $GBENCH_ARGS, e.g. --lengths 16384 --full-lists;
#              --decode: one decoding step; --backward: the sparse attention's forward +
#              backward; --indexer-loss: the indexer's training loss; a Triton gather floor)
#   dbench     bench/gpu_decode_bench.py (split-KV decoding, contiguous and paged, beside SDPA
#              flash and cuDNN, the fused kernels it replaced, and the copy bandwidth; issue 17;
#              $DBENCH_ARGS, e.g. --lengths 4096 32768)
#   sbench     bench/gpu_screening_bench.py (Multiscreen's screening beside SDPA flash and cuDNN
#              at head dimension 64, issue 15; $SBENCH_ARGS, e.g. --lengths 4096)
#   trainbench winnow train-bench (the build's tool) on the compared kinds, then
#              bench/train_baseline.py (the same model and step in PyTorch, eager and
#              torch.compile) against its JSON: parameter count and initial loss checked, tokens/s
#              side by side (issue 11); $TRAINBENCH_ARGS go to both (e.g. --lengths 64),
#              $BASELINE_ARGS to the baseline only, $WINNOW_TRAINBENCH_ARGS to winnow's only
#              (e.g. --profile); JSON and logs in $OUT/train_bench_*
#   pipinstall `pip install .` against this machine's torch (CUDA kernels for the GPU present),
#              then the CPU and CUDA Python tests against the installed package
#              (tools/check_pip_install.sh; scikit-build-core from .whl/)
#   gpt        examples/python_gpt/train_gpt.py --compare under torch.compile: the GPT with
#              winnow.nn attention against the composed expression ($GPT_ARGS; default
#              stick-breaking, L 1024, 50 steps); JSON in $OUT/gpt.json. Uses the build's
#              library, or without a build the package pipinstall left in /tmp
#   ddp        issue 18 on a host with 2+ GPUs (kind nvidia-h100-x2): the MQRAR study's rows
#              ($DDP_ONLY, default Stick-breaking) on one GPU and on $DDP_GPUS (default 2) through
#              NCCL, accuracies and tokens/s side by side (tools/ddp_compare.py; JSON and logs in
#              $OUT/ddp-*); then the PyTorch DDP example (examples/python_ddp) on one process and
#              on $DDP_GPUS under torchrun; $DDP_ARGS go to both studies. A third, shorter run on
#              one GPU with a rank's share of the batch gives the bound on the speed-up
#   study      winnow study $STUDY (default studies/mqrar.json, its cuda profile) with
#              $STUDY_ARGS (e.g. --sweep train.lr=1e-3,3e-3); runs under runs/ (kept while the
#              machine stays warm, so a later call continues), its result files (result.json,
#              table.md, a sweep's JSON and table, plots) copied to $OUT/study-<name>/
# Logs and JSON go to $OUT (default ./gpu-out); a short table is printed last, and after it the
# open issues' bars on what the benches measured (tools/issue_bars.py; $OUT/issue_bars.txt).
# $DEADLINE (seconds): stages that would start later than that after the script's start are
# skipped and listed, so one call of a limited length still prints its table.
# Header-only dependencies come from .gpudeps (tools/prepare_gpu_deps.sh) when the machine
# has no Debian packages; so does ccache, which the build then uses (cache in /tmp, kept while
# the machine stays warm). A parked patch's A/B: tools/parked_ab.sh. For an A/B by hand,
# build, `git apply` the change, build again (only the changed files compile); a later call's
# fresh copy of the working tree keeps its older modification times, so touch the changed
# files before rebuilding there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BUILD=${BUILD:-build-gpu}
BASELINES=${BASELINES:-$PWD/.baselines}
mkdir -p "$OUT"
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(build test sanitize bench)
summary=()
note() { summary+=("$1"); echo "== $1"; }

script_start=$(date +%s)
for stage in "${stages[@]}"; do
  start=$(date +%s)
  if [[ -n "${DEADLINE:-}" ]] && (( start - script_start > DEADLINE )); then
    note "$stage: skipped (past DEADLINE=$DEADLINE s)"
    continue
  fi
  case "$stage" in
    build)
      prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
      deps=()
      [[ -d .gpudeps ]] && deps=(-DWINNOW_DEPS_DIR="$PWD/.gpudeps")
      ccache_bin=$(command -v ccache || true)
      if [[ -z "$ccache_bin" && -x .gpudeps/bin/ccache ]] &&
          LD_LIBRARY_PATH="$PWD/.gpudeps/lib" .gpudeps/bin/ccache --version > /dev/null 2>&1; then
        ccache_bin=$PWD/.gpudeps/bin/ccache
        export LD_LIBRARY_PATH="$PWD/.gpudeps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      fi
      if [[ -n "$ccache_bin" ]]; then
        export CCACHE_DIR=${CCACHE_DIR:-/tmp/winnow-ccache} CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-20G}
        deps+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$ccache_bin" -DCMAKE_CUDA_COMPILER_LAUNCHER="$ccache_bin")
      fi
      # Ninja (the machine's, or .gpudeps's) builds every requested target in one parallel run;
      # make builds them one after another: the operator library's C++ files only started after
      # the test binary had linked (283 s of a cold build on 2026-11-29, most of it the longest
      # CUDA file, then the operator library). A build folder keeps the generator it has.
      # A target list does not shorten a cold build much: on 2026-11-30 winnow_torch alone had
      # not linked after 215 s on a fresh machine, waiting on threshold_attention_forward.cu
      # and threshold_search.cu (each since split in two by element type). Give a cold build
      # four minutes of a call's limit.
      ninja_bin=$(command -v ninja || true)
      [[ -z "$ninja_bin" && -x .gpudeps/bin/ninja ]] && ninja_bin=$PWD/.gpudeps/bin/ninja
      # A copied binary that cannot run there (its C++ library too old) leaves the build to make.
      if [[ -n "$ninja_bin" ]] && ! "$ninja_bin" --version > /dev/null 2>&1; then
        echo "gpu_check: $ninja_bin does not run here; building with make"
        ninja_bin=""
      fi
      if [[ -n "$ninja_bin" && ! -f "$BUILD/CMakeCache.txt" ]]; then
        deps+=(-G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin")
      fi
      cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DCMAKE_PREFIX_PATH="$prefix" -DWINNOW_CUDA=ON -DWINNOW_TORCH=ON \
        -DWINNOW_PYTHON="$(command -v python3)" "${deps[@]}" > "$OUT/configure.log" 2>&1 \
        || { tail -40 "$OUT/configure.log"; note "build: configure FAILED"; break; }
      targets=()
      [[ -n "${BUILD_TARGETS:-}" ]] && targets=(--target $BUILD_TARGETS)
      if cmake --build "$BUILD" -j "$(nproc)" "${targets[@]}" > "$OUT/build.log" 2>&1; then
        note "build: ok ($(( $(date +%s) - start )) s)"
        # ptxas serializes every warpgroup product of a kernel it cannot keep asynchronous (a
        # product in flight across a loop's back edge, C7514; a shared-memory store or named
        # barrier in a divergent path while one runs, C7518; ...), and says so only in the build
        # output: a kernel that silently lost its overlap is named here (ccache replays it).
        serialized=$(grep -E "wgmma.mma_async instructions are serialized" "$OUT/build.log" |
          grep -oE "function '[^']+'" | sort -u)
        if [[ -n "$serialized" ]]; then
          echo "$serialized" | head -10
          note "build: $(echo "$serialized" | wc -l) kernels with serialized warpgroup products (C75xx in build.log)"
        fi
      else
        grep -E "error|Error" "$OUT/build.log" | head -40
        note "build: FAILED"
        break
      fi
      ;;
    pycuda)
      WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so" PYTHONPATH="$PWD/python:$PWD/tests/python" \
        python3 -m pytest -q -p no:cacheprovider tests/python_cuda > "$OUT/pycuda.log" 2>&1
      rc=$?
      grep -E "^(FAILED|ERROR)" "$OUT/pycuda.log" | head -20
      note "pycuda: rc $rc, $(tail -1 "$OUT/pycuda.log") ($(( $(date +%s) - start )) s)"
      ;;
    portable)
      WINNOW_PORTABLE_KERNELS=1 "$BUILD/tests/winnow_cuda_tests" --gtest_brief=1 > "$OUT/cuda_tests_portable.log" 2>&1
      rc=$?
      grep -E "FAILED|PASSED" "$OUT/cuda_tests_portable.log" | head -20
      note "portable: rc $rc, $(grep -E 'PASSED|FAILED' "$OUT/cuda_tests_portable.log" | head -1) ($(( $(date +%s) - start )) s)"
      ;;
    test|cudatest)
      ctest --test-dir "$BUILD" -L cuda --output-on-failure -j 4 > "$OUT/cuda_tests.log" 2>&1
      cuda_rc=$?
      grep -E "tests passed|tests failed" "$OUT/cuda_tests.log" | tail -1
      grep -E "^\s+[0-9]+ - .*\(Failed\)" "$OUT/cuda_tests.log" | head -30
      WINNOW_PORTABLE_KERNELS=1 "$BUILD/tests/winnow_cuda_tests" --gtest_brief=1 > "$OUT/cuda_tests_portable.log" 2>&1
      portable_rc=$?
      grep -E "FAILED|PASSED" "$OUT/cuda_tests_portable.log" | head -20
      summary_line="test: cuda $(grep -E 'tests passed' "$OUT/cuda_tests.log" | tail -1) (rc $cuda_rc); portable kernels rc $portable_rc"
      if [[ "$stage" == test ]]; then
        # Eight tests at once, each LibTorch test with two threads: with LibTorch's default of
        # one thread per core, the model tests oversubscribe the cores and crawl.
        OMP_NUM_THREADS=2 ctest --test-dir "$BUILD" -L cpu --output-on-failure -j 8 > "$OUT/cpu_tests.log" 2>&1
        cpu_rc=$?
        summary_line+="; cpu $(grep -E 'tests passed' "$OUT/cpu_tests.log" | tail -1) (rc $cpu_rc)"
      fi
      note "$summary_line ($(( $(date +%s) - start )) s)"
      ;;
    sanitize)
      # The selection's stored-scores test runs every path twice over, minutes under racecheck;
      # SelectsTheTopKeysOfEveryRow covers the same kernels on the default paths.
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 9 \
          "$BUILD/tests/winnow_cuda_tests" --gtest_filter='CudaSmall.*:CudaBackward.*:CudaTileSkipping.*:CudaEntmax.Sparse*:CudaEntmax.TheForwards*:CudaRotary.*:CudaRMSNorm.*:CudaSwiGLU.*:*ScreeningCuda.*single_token*:*ScreeningCuda.*dk32_suffix*:*ScreeningCuda.*dk16_gqa*:ScreeningCudaSpec.*:CudaGsaSelection.*:CudaGsaSparse.*:CudaGsaIndexerLoss.Small*:CudaSmallDecode.*:*CudaPagedDecode.*d40*:*CudaPagedDecode.*d256*-CudaGsaSelection.StoredScores*' > "$OUT/sanitize_$tool.log" 2>&1
        rc=$?
        note "sanitize $tool: rc $rc, $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
      done
      # The model layer's CUDA paths: fused rotary / RMSNorm / AdamW and the captured step.
      if [[ -x "$BUILD/tests/winnow_model_cuda_tests" ]]; then
        compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/winnow_model_cuda_tests" \
          > "$OUT/sanitize_model_memcheck.log" 2>&1
        rc=$?
        note "sanitize model memcheck: rc $rc, $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_model_memcheck.log" | tail -1)"
      fi
      ;;
    bench)
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      # Baseline wheels carried in .whl/ (AdaSplash-2: `pip download adasplash --no-deps -d .whl`
      # here); the GPU machine has no network, and their dependencies (torch, triton) are there.
      if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --target "$BUILD/site" .whl/*.whl \
          && export PYTHONPATH="$PWD/$BUILD/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      [[ -d "$BASELINES" ]] && export PYTHONPATH="$BASELINES${PYTHONPATH:+:$PYTHONPATH}"
      python3 bench/gpu_attention_bench.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
      note "bench: rc ${PIPESTATUS[0]} ($(( $(date +%s) - start )) s)"
      ;;
    tbench)
      # Threshold attention (issue 14) beside SDPA and, when $BASELINES has 004's
      # triton_threshold_attention.py (snap-research/TDA), the paper's Triton kernels.
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      [[ -d "$BASELINES" ]] && export PYTHONPATH="$BASELINES${PYTHONPATH:+:$PYTHONPATH}"
      python3 bench/gpu_threshold_bench.py --json "$OUT/threshold_bench.json" ${TBENCH_ARGS:-} 2>&1 \
        | tee "$OUT/threshold_bench.txt"
      note "tbench: rc ${PIPESTATUS[0]} ($(( $(date +%s) - start )) s)"
      ;;
    gbench)
      # GSA's selection and sparse attention against SDPA's dense back ends (issue 16).
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      # shellcheck disable=SC2086
      python3 bench/gpu_gsa_bench.py --json "$OUT/gsa_bench.json" ${GBENCH_ARGS:-} 2>&1 | tee "$OUT/gsa_bench.txt"
      note "gbench: rc ${PIPESTATUS[0]} ($(( $(date +%s) - start )) s)"
      ;;
    dbench)
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      # shellcheck disable=SC2086
      python3 bench/gpu_decode_bench.py --json "$OUT/decode_bench.json" ${DBENCH_ARGS:-} 2>&1 | tee "$OUT/decode_bench.txt"
      note "dbench: rc ${PIPESTATUS[0]} ($(( $(date +%s) - start )) s)"
      ;;
    sbench)
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      # shellcheck disable=SC2086
      python3 bench/gpu_screening_bench.py --json "$OUT/screening_bench.json" ${SBENCH_ARGS:-} 2>&1 \
        | tee "$OUT/screening_bench.txt"
      note "sbench: rc ${PIPESTATUS[0]} ($(( $(date +%s) - start )) s)"
      ;;
    trainbench)
      # The fused kinds the baseline writes in PyTorch, and winnow's composed runs beside them.
      # shellcheck disable=SC2086
      "$BUILD/apps/winnow" train-bench --device cuda \
        --kinds softmax_rope,stick_breaking,softmax_rope@composed,stick_breaking@composed \
        --json "$OUT/train_bench_winnow.json" ${TRAINBENCH_ARGS:-} ${WINNOW_TRAINBENCH_ARGS:-} 2>&1 | tee "$OUT/train_bench_winnow.txt"
      winnow_rc=${PIPESTATUS[0]}
      # shellcheck disable=SC2086
      python3 bench/train_baseline.py --device cuda --kinds softmax_rope,stick_breaking \
        --winnow-json "$OUT/train_bench_winnow.json" --json "$OUT/train_bench_baseline.json" \
        ${TRAINBENCH_ARGS:-} ${BASELINE_ARGS:-} 2>&1 | tee "$OUT/train_bench_baseline.txt"
      baseline_rc=${PIPESTATUS[0]}
      note "trainbench: winnow rc $winnow_rc, baseline rc $baseline_rc ($(( $(date +%s) - start )) s)"
      ;;
    pipinstall)
      WINNOW_PIP_CHECK_DIR=/tmp/winnow-pip-check WINNOW_PIP_CHECK_TESTS="$PWD/tests/python_cuda" \
        tools/check_pip_install.sh "$(command -v python3)" > "$OUT/pip_install.log" 2>&1
      rc=$?
      tail -5 "$OUT/pip_install.log"
      note "pipinstall: rc $rc, $(grep -E '^pip install:' "$OUT/pip_install.log"), $(grep -E '[0-9]+ (passed|failed)' "$OUT/pip_install.log" | tail -1) ($(( $(date +%s) - start )) s)"
      ;;
    gpt)
      # The build's library, else the package the pipinstall stage installed.
      if [[ -f "$BUILD/libwinnow_torch.so" ]]; then
        export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so"
      elif [[ -d /tmp/winnow-pip-check/site/winnow ]]; then
        export PYTHONPATH=/tmp/winnow-pip-check/site
      fi
      # shellcheck disable=SC2086
      python3 examples/python_gpt/train_gpt.py --device cuda --compare --json "$OUT/gpt.json" \
        ${GPT_ARGS:---mechanism stick_breaking --length 1024 --steps 50} 2>&1 | tee "$OUT/gpt.txt" \
        | grep -vE "^W[0-9]{4} "
      note "gpt: rc ${PIPESTATUS[0]}, $(grep -E '^kernel / composed' "$OUT/gpt.txt") ($(( $(date +%s) - start )) s)"
      ;;
    study)
      file=${STUDY:-studies/mqrar.json}
      name=$(basename "$file" .json)
      # shellcheck disable=SC2086
      "$BUILD/apps/winnow" study "$file" --set out_dir="runs/gpu-studies/$name" ${STUDY_ARGS:-} \
        2>&1 | tee "$OUT/study-$name.log" | grep -vE "^step [0-9]+/" 
      rc=${PIPESTATUS[0]}
      mkdir -p "$OUT/study-$name"
      # result.json and table.md, a sweep's sweep_<key>.json and .md, and the plots where drawn.
      find "runs/gpu-studies/$name" -maxdepth 1 -type f -exec cp {} "$OUT/study-$name/" \;
      for m in runs/gpu-studies/"$name"/*/metrics.jsonl; do
        [[ -f "$m" ]] && cp "$m" "$OUT/study-$name/$(basename "$(dirname "$m")")-metrics.jsonl"
      done
      note "study $name: rc $rc ($(( $(date +%s) - start )) s)"
      ;;
    ddp)
      gpus=${DDP_GPUS:-2}
      grep -h "data-parallel training" "$OUT/configure.log" 2>/dev/null | tail -1
      rc=0
      for n in 1 "$gpus"; do
        ranks=(); [[ $n -gt 1 ]] && ranks=(--gpus "$n")
        # shellcheck disable=SC2086
        "$BUILD/apps/winnow" study studies/mqrar.json --only "${DDP_ONLY:-Stick-breaking}" --fresh "${ranks[@]}" \
          --set out_dir="runs/ddp-$n" ${DDP_ARGS:-} 2>&1 | tee "$OUT/ddp-study-$n.log" | grep -vE "^step [0-9]+/"
        (( rc |= PIPESTATUS[0] ))
        cp "runs/ddp-$n/result.json" "$OUT/ddp-study-$n.json" 2>/dev/null
        for m in runs/ddp-"$n"/*/metrics.jsonl; do
          [[ -f "$m" ]] && cp "$m" "$OUT/ddp-study-$n-$(basename "$(dirname "$m")")-metrics.jsonl"
        done
      done
      # The same steps on one GPU and on N (float32, CUDA graphs on, small buckets so that
      # several all-reduces start from the backward pass): losses at every step side by side.
      for n in 1 "$gpus"; do
        ranks=(); [[ $n -gt 1 ]] && ranks=(--gpus "$n")
        "$BUILD/apps/winnow" train --config configs/toy/stick_breaking.json --fresh "${ranks[@]}" \
          --set train.dtype=float32 --set train.steps=60 --set train.log_every=1 --set train.eval_every=0 \
          --set train.bucket_mb=0.25 --set train.out_dir="runs/ddp-steps-$n" > "$OUT/ddp-steps-$n.log" 2>&1 || rc=1
      done
      python3 - "$gpus" <<'PY' | tee "$OUT/ddp-steps.txt"
import json, sys
def losses(n):
    return [json.loads(l)["loss"] for l in open(f"runs/ddp-steps-{n}/metrics.jsonl") if '"loss"' in l and '"train"' in l]
a, b = losses(1), losses(sys.argv[1])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if a and len(a) == len(b) else float("nan")
print(f"toy stick-breaking, float32, 60 steps: one GPU vs {sys.argv[1]}: {len(a)} / {len(b)} logged losses, "
      f"largest relative difference {worst:.2e} (first {a[0]:.6f} / {b[0]:.6f}, last {a[-1]:.6f} / {b[-1]:.6f})")
PY
      # One GPU with a rank's share of the batch: the speed-up that free communication would give.
      batch=$("$BUILD/apps/winnow" study studies/mqrar.json --print | python3 -c "import json,sys; print(json.load(sys.stdin)['base']['train']['batch_size'])")
      "$BUILD/apps/winnow" study studies/mqrar.json --only "${DDP_ONLY:-Stick-breaking}" --fresh --quiet \
        --set base.train.batch_size=$(( batch / gpus )) --set base.train.steps=1000 --set eval.multiples=[1] \
        --set eval.instances=100 --set out_dir=runs/ddp-share > "$OUT/ddp-share.log" 2>&1 || rc=1
      python3 tools/ddp_compare.py runs/ddp-1 "runs/ddp-$gpus" --share runs/ddp-share --json "$OUT/ddp-compare.json" \
        | tee "$OUT/ddp-compare.md"
      export WINNOW_LIBRARY="$PWD/$BUILD/libwinnow_torch.so" PYTHONPATH="$PWD/python" NCCL_NVLS_ENABLE=0
      python3 examples/python_ddp/train_ddp.py --device cuda --json "$OUT/ddp-example-1.json" \
        > "$OUT/ddp-example-1.log" 2>&1 || rc=1
      torchrun --standalone --nproc-per-node "$gpus" examples/python_ddp/train_ddp.py --device cuda \
        --json "$OUT/ddp-example-$gpus.json" > "$OUT/ddp-example-$gpus.log" 2>&1 || rc=1
      tail -n 2 "$OUT/ddp-example-1.log" "$OUT/ddp-example-$gpus.log"
      # A call brings back only a few files: the logs and the studies' own results travel as one.
      (cd "$OUT" && tar czf ddp-logs.tar.gz ddp-study-* ddp-steps* ddp-share.log ddp-example-*.log 2>/dev/null \
        && rm -f ddp-study-* ddp-steps* ddp-share.log ddp-example-*.log)
      note "ddp: rc $rc ($(( $(date +%s) - start )) s)"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo
printf '%s\n' "${summary[@]}"
# The open issues' bars on what this run's benches measured (tools/issue_bars.py).
bar_inputs=()
for f in bench.json decode_bench.json threshold_bench.json; do [[ -f "$OUT/$f" ]] && bar_inputs+=("$OUT/$f"); done
if (( ${#bar_inputs[@]} > 0 )); then
  echo
  python3 tools/issue_bars.py "${bar_inputs[@]}" | grep -v "not measured" | tee "$OUT/issue_bars.txt"
fi
