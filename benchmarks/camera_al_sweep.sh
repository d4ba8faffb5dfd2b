#!/usr/bin/env bash
# The camera AL sweep the docs quote: the issue's must-hold settings x 5 seeds x the samplers, JSON, curves and one table in OUT.
# Usage: bash benchmarks/camera_al_sweep.sh OUT [JOBS] [SEEDS...]   (CAMERA_AL_EXTRA="--per-class 20 --rounds 3": a smoke run;
#        CAMERA_AL_WORK=DIR: the feature cache there instead of OUT/work, e.g. outside what a lent machine sends back)
#   (on a lent machine: bash benchmarks/device_carry.sh here, then bash benchmarks/on_device.sh bash benchmarks/camera_al_sweep.sh OUT there)
# Settings: balanced 96 px, imbalanced 20:1 at 96 and 160 px, a long tail (share ~ rank^-1.5) at 96 px, and the balanced
# and 20:1 fleets at 96 px dealt to the devices non-IID (each class in Dirichlet(0.3) shares), where fleet-level
# selection runs too. The fleets are rendered and embedded first (on the GPU when torch sees one), the 160 px ones beside
# the 96 px ones, cached in OUT/work (or CAMERA_AL_WORK); then the six settings run side by side, JOBS processes in all
# (default: every core), each on one thread; then OUT/table.md gathers the settings' rows and must-hold checks.
set -euo pipefail
out=$(realpath -m "${1:?usage: camera_al_sweep.sh OUT [JOBS] [SEEDS...]}")
jobs=${2:-$(nproc)}
if (($# > 2)); then seeds=("${@:3}"); else seeds=(0 1 2 3 4); fi
samplers=(random margin typical-then-balanced-margin typical-then-margin typiclust balanced-margin typical-then-level-margin
  oracle-balanced)
cd "$(dirname "$0")"
export PYTHONPATH="$PWD/..${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
read -r -a extra <<<"${CAMERA_AL_EXTRA:-}"
work=$(realpath -m "${CAMERA_AL_WORK:-$out/work}")
mkdir -p "$work"
source ./camera_al_settings.sh  # flags: each setting's camera_al.py flags
declare -A more=(  # fleet-level selection where the devices' class mixes differ: the fleet's counts against the device's
  [dirichlet-96]="fleet:typical-then-level-margin"
  [dirichlet-imbalanced20-96]="fleet:typical-then-level-margin"
)
features() {
  # shellcheck disable=SC2086  # the flags are words
  python3 camera_al.py --work "$work" --features-only ${flags[$1]} "${extra[@]}" >"$out/$1.features.json" 2>>"$out/$1.log"
}
started=$(date +%s)
for name in "${!flags[@]}"; do mkdir -p "$out/$name"; : >"$out/$name.log"; done
features imbalanced20-160 & big=$!  # renders and embeds the balanced 160 px fleet first, then its new scenes
features balanced-96
features imbalanced20-96 & small=$!  # both read the balanced 96 px fleet's cache
features longtail-96
wait "$small"
wait "$big"
echo "features: $(($(date +%s) - started)) s" >&2
share=$(((jobs + ${#flags[@]} - 1) / ${#flags[@]}))
pids=()
for name in "${!flags[@]}"; do
  # shellcheck disable=SC2086
  python3 camera_al.py --work "$work" --jobs "$share" --seeds "${seeds[@]}" --samplers "${samplers[@]}" ${more[$name]:-} \
    --setting "$name" --figures "$out/$name" ${flags[$name]} "${extra[@]}" >"$out/$name/camera_al.json" 2>>"$out/$name.log" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "all: $(($(date +%s) - started)) s" >&2
python3 camera_al_stats.py "$out"/{balanced-96,imbalanced20-96,imbalanced20-160,longtail-96,dirichlet-96,dirichlet-imbalanced20-96}/camera_al.json \
  >"$out/table.md"
cat "$out/table.md"
