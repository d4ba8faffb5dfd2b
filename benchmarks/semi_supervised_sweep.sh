#!/usr/bin/env bash
# The semi-supervised camera sweep: supervised-only against the pseudo-labels rule, the camera default and random, 5 seeds.
# Usage: bash benchmarks/semi_supervised_sweep.sh OUT [SETTING...]   (default: balanced-96 imbalanced20-96; the others:
#        longtail-96 dirichlet-96 dirichlet-imbalanced20-96 imbalanced20-160). CAMERA_AL_WORK=DIR: the feature cache
#        (default OUT/work); CAMERA_AL_EXTRA="--per-class 20 --rounds 3": a smoke run; SEMI_SAMPLERS="random ...": the
#        curves (default: random, the camera default, both under the rule). One setting at a time, one
#        process, niced (a shared machine); then semi_supervised_stats.py writes OUT/summary.json and OUT/table.md.
set -euo pipefail
out=$(realpath -m "${1:?usage: semi_supervised_sweep.sh OUT [SETTING...]}")
if (($# > 1)); then settings=("${@:2}"); else settings=(balanced-96 imbalanced20-96); fi
read -r -a samplers <<<"${SEMI_SAMPLERS:-random typical-then-balanced-margin semi:typical-then-balanced-margin semi:random}"
cd "$(dirname "$0")"
export PYTHONPATH="$PWD/..${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
read -r -a extra <<<"${CAMERA_AL_EXTRA:-}"
work=$(realpath -m "${CAMERA_AL_WORK:-$out/work}")
mkdir -p "$work"
source ./camera_al_settings.sh  # flags: each setting's camera_al.py flags
for name in "${settings[@]}"; do
  [[ -n "${flags[$name]:-}" ]] || { echo "unknown setting $name; known: ${!flags[*]}" >&2; exit 2; }
  mkdir -p "$out/$name"
  started=$(date +%s)
  # shellcheck disable=SC2086  # the flags are words
  nice -n 10 python3 camera_al.py --work "$work" --jobs 1 --samplers "${samplers[@]}" --setting "$name" \
    --figures "$out/$name" ${flags[$name]} "${extra[@]}" >"$out/$name/camera_al.json" 2>"$out/$name.log"
  echo "$name: $(($(date +%s) - started)) s" >&2
done
python3 semi_supervised_stats.py "$out"/*/camera_al.json --out "$out"
