#!/usr/bin/env bash
# The pooled head's sweep (issue 44): IID, Dirichlet 0.3 and 0.1 (balanced) and 20:1 dealt Dirichlet 0.3, 96 px, 5 seeds,
# FedAvg of trained heads against pooled-head for random and the camera default; JSON, curves and a table in OUT.
# Usage: bash benchmarks/pooled_head_sweep.sh OUT [JOBS] [SEEDS...]   (CAMERA_AL_WORK=DIR: the feature cache there;
#        CAMERA_AL_EXTRA="--per-class 20 --rounds 3": a smoke run). Each setting's JSON holds, per run and round, the
#        federated and centralised accuracy and each device's served accuracy on test images dealt like its pool.
set -euo pipefail
out=$(realpath -m "${1:?usage: pooled_head_sweep.sh OUT [JOBS] [SEEDS...]}")
jobs=${2:-$(nproc)}
if (($# > 2)); then seeds=("${@:3}"); else seeds=(0 1 2 3 4); fi
samplers=(random typical-then-balanced-margin pooled:random pooled:typical-then-balanced-margin)
cd "$(dirname "$0")"
export PYTHONPATH="$PWD/..${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
read -r -a extra <<<"${CAMERA_AL_EXTRA:-}"
work=$(realpath -m "${CAMERA_AL_WORK:-$out/work}")
mkdir -p "$work"
names=(iid-96 dirichlet0.3-96 dirichlet0.1-96 dirichlet0.3-imbalanced20-96)
declare -A flags=(
  [iid-96]="--size 96"
  [dirichlet0.3-96]="--size 96 --dirichlet 0.3"
  [dirichlet0.1-96]="--size 96 --dirichlet 0.1"
  [dirichlet0.3-imbalanced20-96]="--size 96 --imbalance 20 --dirichlet 0.3"
)
started=$(date +%s)
for name in "${names[@]}"; do
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086  # the flags are words
  python3 camera_al.py --work "$work" --jobs "$jobs" --seeds "${seeds[@]}" --samplers "${samplers[@]}" \
    --setting "$name" --figures "$out/$name" ${flags[$name]} "${extra[@]}" >"$out/$name/camera_al.json" 2>"$out/$name.log"
  echo "$name: $(($(date +%s) - started)) s" >&2
done
python3 pooled_head_stats.py --figures $(printf "$out/%s/camera_al.json " "${names[@]}") >"$out/table.md"
cat "$out/table.md"
