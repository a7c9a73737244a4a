#!/usr/bin/env bash
# The 3-seed sweeps of EXPERIMENTS.md that need more than this project's 2-core machine: written
# here, trained on an accelerator host whose image has JAX but no TensorFlow.
#
#   scripts/seed_sweeps.sh write ROOT NAME...          # a host with the data layer: ROOT/batches
#   scripts/seed_sweeps.sh train ROOT PARALLEL NAME... # the accelerator host: ROOT/<NAME> sweeps
#
# NAME: synthesizer_span, synthesizer_lm, magneto_mlm, magneto_span, deepnet_6, deepnet_18,
# deepnet_50, deepnet_100 (the 4 placements x paper / code init), lr_depth2, lr_depth8 (3 seeds
# each), glu5 (GLU Table 1, 5 seeds), deepnet_500 (DeepNet's 1,000-layer model at the recipes'
# width: Post-LN and DeepNorm, paper init, 1 seed). Both steps are resumable (written batches
# and finished runs are kept).
set -u
MODE=$1 ROOT=$2
shift 2
PARALLEL=1
if [ "$MODE" = train ]; then PARALLEL=$1; shift; fi
SWEEP=${T5XV_SWEEP:-t5xv-sweep}
NORM=gin/variants/norm INIT=gin/variants/init/xavier.gin,gin/variants/init/torchscale.gin
ALL_NORMS=$NORM/post_ln.gin,$NORM/deepnorm.gin,$NORM/pre_ln.gin,$NORM/subln.gin

sweep() {  # name, t5xv-sweep flags
  local name=$1
  shift
  if [ "$MODE" = write ]; then
    $SWEEP --sweep_dir="$ROOT/$name" --batches_dir="$ROOT/batches" --write_batches "$@"
  else
    $SWEEP --sweep_dir="$ROOT/$name" --batches_dir="$ROOT/batches" --parallel="$PARALLEL" "$@"
  fi
}

for name in "$@"; do
  case $name in
    synthesizer_span|synthesizer_lm)
      task=${name#synthesizer_}; task=${task/span/span_corruption}
      sweep "$name" --gin_file="gin/experiments/synthesizer/${task}_small.gin" \
        --variants='gin/variants/attention/*.gin' --seeds=3 --paper=synthesizer ;;
    magneto_mlm|magneto_span)
      task=${name#magneto_}; task=${task/span/span_corruption}
      sweep "$name" --gin_file="gin/experiments/foundation/${task}_small.gin" \
        --variants="$NORM/pre_ln.gin,$NORM/subln.gin" --variants="$INIT" --seeds=3 --paper=magneto ;;
    deepnet_6|deepnet_18|deepnet_50|deepnet_100)
      sweep "$name" --gin_file=gin/experiments/deepnet/span_corruption_small.gin \
        --variants="$ALL_NORMS" --variants="$INIT" \
        --variants="gin/experiments/deepnet/depth_${name#deepnet_}.gin" --seeds=3 --paper=deepnet ;;
    deepnet_500)
      sweep "$name" --gin_file=gin/experiments/deepnet/span_corruption_small.gin \
        --variants="$NORM/post_ln.gin,$NORM/deepnorm.gin" --variants=gin/variants/init/xavier.gin \
        --gin.TransformerConfig.num_encoder_layers=500 --gin.TransformerConfig.num_decoder_layers=500 \
        --seeds=1 --paper=deepnet ;;
    lr_depth2|lr_depth8)
      sweep "$name" --gin_file=gin/experiments/stability/lm_small.gin \
        --variants="$ALL_NORMS" --variants="$INIT" \
        --grid=learning_rate_schedule.base=3e-4,1e-3,3e-3,1e-2,3e-2 \
        --gin.TransformerConfig.num_decoder_layers="${name#lr_depth}" --seeds=3 ;;
    glu5)
      sweep "$name" --gin_file=gin/experiments/glu_variants/small.gin \
        --variants='gin/variants/ffn/*.gin' --seeds=5 --paper=glu ;;
    *) echo "seed_sweeps.sh: unknown sweep $name" >&2; exit 2 ;;
  esac
done
