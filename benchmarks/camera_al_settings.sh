# The camera AL sweep's settings, camera_al.py's flags by name; sourced by camera_al_sweep.sh and semi_supervised_sweep.sh.
# shellcheck shell=bash disable=SC2034  # the array is read by the scripts that source this file
declare -A flags=(
  [balanced-96]="--size 96"
  [imbalanced20-96]="--size 96 --imbalance 20"
  [imbalanced20-160]="--size 160 --imbalance 20"
  [longtail-96]="--size 96 --long-tail 1.5"
  [dirichlet-96]="--size 96 --dirichlet 0.3"
  [dirichlet-imbalanced20-96]="--size 96 --imbalance 20 --dirichlet 0.3"
)
