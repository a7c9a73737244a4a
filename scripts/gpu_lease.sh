#!/usr/bin/env bash
# One call on a lent GPU machine whose image lacks gin and tensorboardX: install the wheels
# carried in .whl/, run scripts/gpu_bench.sh's jobs one after another until SECONDS have passed,
# and pack every log and JSON into $OUT/all.tgz (a call brings back a few files, not a folder),
# again after each job, so that a call cut short still brings back the jobs it finished.
#
#   scripts/gpu_lease.sh SECONDS JOB...      e.g. scripts/gpu_lease.sh 560 x128 r128_full tests
#
# The wheels, fetched once on the host that sends the call (Python 3.12 is the device image's):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl gin-config==0.5.0 tensorboardX==2.6.5
# A benchmark job that would start with under 75 s left is not started (compiling T5-base and
# its warm-up steps take most of a minute; a cut one brings back nothing), a test job with under
# 30 s; the jobs not run are named.
set -u
budget=${1:?SECONDS}
shift
start=$(date +%s)
: "${OUT:?OUT: the folder whose files come back}"
rm -rf /tmp/gpu_lease  # (a warm machine may hold an earlier call's)
out=/tmp/gpu_lease/all  # outside $OUT: only all.tgz comes back, however many logs there are
mkdir -p "$out"
# written beside and renamed: a call killed at its limit while packing keeps the previous pack
# (and brings back the cut all.tgz.part too)
pack() {
  tar czf "$OUT/all.tgz.part" -C "$(dirname "$out")" all && mv -f "$OUT/all.tgz.part" "$OUT/all.tgz"
}
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$out/wheels.log" 2>&1; then
  echo "the wheels in .whl/ could not be installed (carry=['.whl'], fetched as above?)" |
    tee -a "$out/wheels.log"
  pack
  exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the console scripts (t5xv-train, t5xv-export, ...) that the suite's end-to-end tests run
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
  >"$out/install.log" 2>&1 ||
  echo "the project's console scripts could not be installed" | tee -a "$out/install.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import jax, flax, optax, orbax.checkpoint as ocp, torch, transformers
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, "orbax",
      ocp.__version__, "torch", torch.__version__, "transformers", transformers.__version__, jax.devices())'
  git log -1 --format='code %H' 2>/dev/null
  git status --short 2>/dev/null | sed 's/^/changed: /'  # (the tree sent)
} >"$out/machine.txt" 2>&1
pack
for job in "$@"; do
  left=$((budget - ($(date +%s) - start)))
  case $job in *tests) least=30 ;; *) least=75 ;; esac
  if ((left < least)); then
    echo "deadline: not run: $*" | tee -a "$out/machine.txt"
    break
  fi
  GPU_BENCH_MAX_S=$left scripts/gpu_bench.sh "$out" "$job"
  pack
  shift
done
pack
