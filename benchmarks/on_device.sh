#!/usr/bin/env bash
# Runs a command on the lent machine with what .devcarry/ brought (see device_carry.sh): `bash benchmarks/on_device.sh python3 benchmarks/...`.
set -euo pipefail
cd "$(dirname "$0")/.."
carry="$PWD/.devcarry"
mkdir -p /usr/share/datasets
[ -e /usr/share/datasets/fashion-mnist ] || ln -s "$carry/fmnist" /usr/share/datasets/fashion-mnist
export PATH="$carry/bin:$PATH" LD_LIBRARY_PATH="$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$PWD:$carry/py${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
