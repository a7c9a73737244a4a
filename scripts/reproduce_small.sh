#!/usr/bin/env bash
# The earlier small-scale grid of EXPERIMENTS.md (1-2 seeds per table: GLU, then the cheapest run
# of each other table first), then one t5xv-report over all of them. The multi-seed tables are
# scripts/seed_sweeps.sh and the commands in each EXPERIMENTS.md section. Resumable: run it again and finished runs are skipped.
#
#   scripts/reproduce_small.sh [SWEEP_ROOT] [REPORT_DIR]     (defaults: /tmp/t5xv_sweeps, docs/experiments)
#
# About 4 minutes per 2+2-layer run on 2 CPU cores; deeper DeepNet runs cost in proportion to depth.
# A sweep with failed runs does not stop the others (see each sweep's sweep.json).
set -uo pipefail
trap 'exit 130' INT  # Ctrl-C stops the script (each sweep saves its running run's checkpoint)
cd "$(dirname "$0")/.."
ROOT=${1:-/tmp/t5xv_sweeps}
REPORT=${2:-docs/experiments}
BIN=${T5XV_BIN:-.venv/bin}
sweep() {
  "$BIN/t5xv-sweep" "$@"
  case $? in 0) ;; 130) exit 130 ;; *) echo "t5xv-sweep $1: some runs failed (see sweep.json)" ;; esac
}
NORM=gin/variants/norm
DEPTH=gin/experiments/deepnet
NORMS=$NORM/post_ln.gin,$NORM/deepnorm.gin,$NORM/pre_ln.gin,$NORM/subln.gin
SYNTH='gin/variants/attention/*.gin'

# 1. GLU variants, Table 1: the 8 FFNs, parameter-matched, span corruption, 2 seeds.
sweep --sweep_dir="$ROOT/glu" --gin_file=gin/experiments/glu_variants/small.gin \
  --variants='gin/variants/ffn/*.gin' --seeds=2 --paper=glu
# The cheapest run of each table first; a sweep called again with more variants grows.
magneto() {
  sweep --sweep_dir="$ROOT/magneto_$1" --gin_file="gin/experiments/foundation/${1}_small.gin" \
    --variants="$NORM/pre_ln.gin,$NORM/subln.gin" --seeds=1 --paper=magneto
}
deepnet() {  # placements, depths
  sweep --sweep_dir="$ROOT/deepnet" --gin_file=gin/experiments/deepnet/span_corruption_small.gin \
    --variants="$1" --variants="$2" --gin.train.diagnostics_period=10 --seeds=1 --paper=deepnet
}
synthesizer() {
  sweep --sweep_dir="$ROOT/synthesizer_$1" --gin_file="gin/experiments/synthesizer/${1}_small.gin" \
    --variants="$SYNTH" --seeds=1 --paper=synthesizer
}
# 2. Magneto: Pre-LN vs Sub-LN (LayerNorm) on causal LM and MLM ...
magneto lm
magneto mlm
# 3. DeepNet: Post-LN vs DeepNorm at 6+6 layers, with the per-layer diagnostics ...
deepnet "$NORM/post_ln.gin,$NORM/deepnorm.gin" "$DEPTH/depth_6.gin"
# 4. Synthesizer: every attention variant on span corruption.
synthesizer span_corruption
# 2. ... Magneto on span corruption; 3. ... Pre-LN and Sub-LN at 6+6, then all four at 18+18
# (about 3x the cost of a 6+6 run); 4. ... the Synthesizers on causal LM.
magneto span_corruption
deepnet "$NORMS" "$DEPTH/depth_6.gin"
deepnet "$NORMS" "$DEPTH/depth_6.gin,$DEPTH/depth_18.gin"
synthesizer lm

"$BIN/t5xv-report" --output_dir="$REPORT" --title='Small-scale replications' \
  $(for d in glu magneto_lm magneto_mlm magneto_span_corruption deepnet synthesizer_span_corruption synthesizer_lm; do
      [ -f "$ROOT/$d/sweep.json" ] && echo "--sweep_dir=$ROOT/$d"; done)
