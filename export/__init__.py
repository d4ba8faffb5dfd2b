# Model export for devices: ONNX graphs that keep MC dropout (explicit masks), int8 quantization, model bundles.
