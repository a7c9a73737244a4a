#!/usr/bin/env bash
# The small-scale replications of EXPERIMENTS.md: one t5xv-sweep per table, in order of cost,
# then one t5xv-report over all of them. Resumable: run it again and finished runs are skipped.
#
#   scripts/reproduce_small.sh [SWEEP_ROOT] [REPORT_DIR]     (defaults: /tmp/t5xv_sweeps, docs/experiments)
#
# About 4 minutes per 2+2-layer run on 2 CPU cores; deeper DeepNet runs cost in proportion to depth.
# A sweep with failed runs does not stop the others (see each sweep's sweep.json).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-/tmp/t5xv_sweeps}
REPORT=${2:-docs/experiments}
BIN=${T5XV_BIN:-.venv/bin}
sweep() { "$BIN/t5xv-sweep" "$@" || echo "t5xv-sweep $1: some runs failed (see sweep.json)"; }
NORMS=gin/variants/norm/post_ln.gin,gin/variants/norm/deepnorm.gin,gin/variants/norm/pre_ln.gin,gin/variants/norm/subln.gin
SYNTH='gin/variants/attention/*.gin'

# 1. GLU variants, Table 1: the 8 FFNs, parameter-matched, span corruption, 2 seeds.
sweep --sweep_dir="$ROOT/glu" --gin_file=gin/experiments/glu_variants/small.gin \
  --variants='gin/variants/ffn/*.gin' --seeds=2 --paper=glu
# 2. Magneto: Pre-LN vs Sub-LN (LayerNorm) on causal LM, MLM and span corruption.
for objective in lm mlm span_corruption; do
  sweep --sweep_dir="$ROOT/magneto_$objective" --gin_file="gin/experiments/foundation/${objective}_small.gin" \
    --variants=gin/variants/norm/pre_ln.gin,gin/variants/norm/subln.gin --seeds=1 --paper=magneto
done
# 3. DeepNet: the four placements over depth, with the per-layer diagnostics: 6+6 layers first ...
DEEPNET=(--sweep_dir="$ROOT/deepnet" --gin_file=gin/experiments/deepnet/span_corruption_small.gin
         --variants="$NORMS" --gin.train.diagnostics_period=10 --seeds=1 --paper=deepnet)
sweep "${DEEPNET[@]}" --variants=gin/experiments/deepnet/depth_6.gin
# 4. Synthesizer: every attention variant on span corruption ...
sweep --sweep_dir="$ROOT/synthesizer_span_corruption" \
  --gin_file=gin/experiments/synthesizer/span_corruption_small.gin --variants="$SYNTH" --seeds=1 --paper=synthesizer
# ... DeepNet's 18+18 layers (the same sweep, grown: about 4x the cost of a 6+6 run) ...
sweep "${DEEPNET[@]}" --variants=gin/experiments/deepnet/depth_6.gin,gin/experiments/deepnet/depth_18.gin
# ... and the Synthesizers on causal LM.
sweep --sweep_dir="$ROOT/synthesizer_lm" --gin_file=gin/experiments/synthesizer/lm_small.gin \
  --variants="$SYNTH" --seeds=1 --paper=synthesizer

"$BIN/t5xv-report" --output_dir="$REPORT" --title='Small-scale replications' \
  $(for d in glu magneto_lm magneto_mlm magneto_span_corruption deepnet synthesizer_span_corruption synthesizer_lm; do
      [ -f "$ROOT/$d/sweep.json" ] && echo "--sweep_dir=$ROOT/$d"; done)
