# The names and opset every exported graph shares (torch-free, so graphs built in numpy use them too).
from __future__ import annotations

DEFAULT_OPSET = 17
IMAGES_INPUT = "images"
FEATURES_NAME = "features"
PROBABILITIES_OUTPUT = "probabilities"
PENULTIMATE_OUTPUT = "penultimate"
EMBEDDINGS_OUTPUT = "embeddings"
