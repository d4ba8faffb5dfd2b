# Model export for devices (ONNX bundles).
