#!/usr/bin/env bash
# The GPU table of BENCHMARKS.md in one call on one GPU host: t5xv-bench and its HF T5 peer
# (same shape, batch, dtype and optimizer, one process after the other on the same GPU), the
# profile, the remat policies and the suite. Each job's output lands in OUTDIR/JOB.log (and
# OUTDIR/JOB.json for the bench jobs).
#
#   scripts/gpu_bench.sh OUTDIR JOB...
#
# JOB: h32, h128 (defaults: ours with --profile, and HF + torch.compile, Adafactor), h128a (both
# with AdamW: optax / PyTorch's fused), x128 (the XLA attention path), rBATCH_POLICY (ours alone
# with a remat policy, e.g. r128_none, r32_full, r128_save_qkv_attention), d128 (ours alone,
# the defaults, Dense contracted as one dot_general: beside r128_full, the 2-D matmul), p128 (ours
# alone on packed rows, as a pretraining run with packing: the XLA attention path on a GPU), gpu_tests
# (the tests that need a GPU: cuDNN against the reference path), tests (the suite with
# JAX_PLATFORMS=cuda, slow tests left out, at most 400 s; on a 16-core H200 host 12 workers ran
# 64% of it in 3 minutes).
# GPU_BENCH_MAX_S, if set, caps each job's seconds (a lease's deadline).
set -u
OUT=${1:?OUTDIR}
shift
mkdir -p "$OUT"
BENCH=(python3 -m t5x_variants.cli.bench --gin_file=gin/models/t5_base.gin --inputs_length=512
       --targets_length=114 --steps=10 --warmup=2 --peak_tflops=989)
FULL=(env XLA_PYTHON_CLIENT_MEM_FRACTION=.95)  # batch 128: JAX's pool may take 95% of the GPU
run() {  # job, seconds, command...
  local job=$1 limit=$2
  (( ${GPU_BENCH_MAX_S:-$limit} < limit )) && limit=$GPU_BENCH_MAX_S
  shift 2
  echo "== $job $(date +%T): $*"
  # SIGINT first: pytest then prints the failures it has seen before it stops
  timeout -s INT -k 30 "$limit" "$@" >"$OUT/$job.log" 2>&1
  echo "rc=$? $(grep -E 'tok/s|HF PyTorch|passed|failed|by category|profile:' "$OUT/$job.log" | cut -c1-400)"
}
for job in "$@"; do
  case $job in
    h32) run "$job" 400 "${BENCH[@]}" --batch=32 --hf --hf_compile --profile --output="$OUT/$job.json" ;;
    h128) run "$job" 500 "${FULL[@]}" "${BENCH[@]}" --batch=128 --hf --hf_compile --profile --output="$OUT/$job.json" ;;
    h128a) run "$job" 500 "${FULL[@]}" "${BENCH[@]}" --batch=128 --hf --hf_compile \
             --gin.make_optimizer.optimizer=@adamw --output="$OUT/$job.json" ;;
    # x128, r*, d128 and p128 without --profile: it turns XLA's command buffers off for the whole
    # process (~4% of a step), so that they time alike; h32/h128 profile (and say so in the JSON)
    x128) run "$job" 300 "${FULL[@]}" "${BENCH[@]}" --batch=128 \
            --gin.TransformerConfig.attention_kernel="'xla'" --output="$OUT/$job.json" ;;
    r[0-9]*_*) batch=${job%%_*}; run "$job" 300 "${FULL[@]}" "${BENCH[@]}" --batch="${batch#r}" \
              --gin.TransformerConfig.remat="'${job#*_}'" --output="$OUT/$job.json" ;;
    p128) run "$job" 300 "${FULL[@]}" "${BENCH[@]}" --batch=128 --packed --output="$OUT/$job.json" ;;
    d128) run "$job" 300 "${FULL[@]}" T5XV_DENSE_CONTRACTION=dot_general "${BENCH[@]}" --batch=128 \
            --output="$OUT/$job.json" ;;
    gpu_tests) run "$job" 300 env JAX_PLATFORMS=cuda python3 -m pytest -v -p no:cacheprovider \
                 tests/test_fused_attention.py -k 'cudnn or no_valid_key' ;;
    tests) run "$job" 400 env JAX_PLATFORMS=cuda python3 -m pytest -v -rfE --tb=short -n 12 -p no:cacheprovider \
             -m 'not slow' tests ;;
    *) echo "unknown job $job" ;;
  esac
done
