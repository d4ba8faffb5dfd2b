# What EfficientNet-Lite0 costs a device per input size: ONNX prefix speed and memory, int8 agreement, last:N training.
"""Prints one JSON object (run by hand; a few minutes on 2 cores).

For each input size (96/160/224 px) it exports the pretrained spec's bundle with an int8 prefix (fl-export's own
path: `write_bundle` with calibration crops of matplotlib's sample photos), then measures, each case in a fresh
process so its peak RSS (/proc VmHWM) is its own:
- `inference`: images per second of the fp32 and int8 prefix in onnxruntime with 1 and 2 threads (batch 8), and
  the process's peak RSS (numpy + onnxruntime + the session + a batch; torch never imported);
- `training`: a torch device's training step on `last:N` (N = 1, 2, 4) at batch 8 and 16 (SGD with momentum, the
  frozen prefix run without autograd; one warm-up step, then 3 timed), seconds per step and peak RSS (torch
  imported, 2 threads);
- `int8_agreement`: the 1000-class ImageNet model, fp32 against int8 prefix on held-out crops: top-1 agreement,
  the cosine of the 1280 features, and the sample photo's class 652 probability in each.
`fits` maps each device profile of firmware_configs/ (its memory_budget_mb and trainer) to the sizes whose
measured peak RSS fits its budget. Speeds are this machine's (x86, shared cores), not the boards'.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = (96, 160, 224)
CLASSES = ["empty", "person", "vehicle", "animal", "package"]
SPEC_VALUES = {"architecture": "efficientnet-lite0", "channels": 3, "mean": [0.5] * 3, "std": [0.5] * 3}
CROPS = 32
INFERENCE_BATCH = 8
TRAINING_STEPS = 3


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM) in MB, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def inference_case(case: dict[str, Any]) -> dict[str, Any]:
    """Images per second of one prefix graph in onnxruntime, and the process's peak RSS (torch never imported)."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = case["threads"], 1
    session = ort.InferenceSession(case["graph"], options, providers=["CPUExecutionProvider"])
    size = case["size"]
    batch = np.random.default_rng(0).random((INFERENCE_BATCH, 3, size, size), dtype=np.float32)
    session.run(None, {"images": batch})
    runs, start = 0, time.perf_counter()
    while runs < 2 or (time.perf_counter() - start < case["seconds"] and runs < 50):
        session.run(None, {"images": batch})
        runs += 1
    elapsed = time.perf_counter() - start
    return {"images_per_second": runs * INFERENCE_BATCH / elapsed, "peak_rss_mb": peak_rss_mb()}


def training_case(case: dict[str, Any]) -> dict[str, Any]:
    """Seconds per training step of a torch device on last:N at the batch size, and the process's peak RSS."""
    import numpy as np
    import torch

    from edge_agent.learning.pretrained_backbone import initial_model
    from edge_agent.learning.training import TrainSettings, train_supervised
    from protocol.model_spec import ModelSpec

    torch.set_num_threads(case["threads"])
    size, batch = case["size"], case["batch"]
    spec = ModelSpec(
        **SPEC_VALUES, height=size, width=size, class_names=CLASSES, pretrained="imagenet", trainable=case["trainable"]
    )
    model = initial_model(spec, seed=0)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (batch * TRAINING_STEPS, size, size, 3), dtype=np.uint8)
    labels = rng.integers(0, len(CLASSES), len(images))
    before = peak_rss_mb()
    train_supervised(model, images[:batch], labels[:batch], TrainSettings(1, batch, 0.01, momentum=0.9))
    start = time.perf_counter()
    train_supervised(model, images, labels, TrainSettings(1, batch, 0.01, momentum=0.9))
    seconds = (time.perf_counter() - start) / TRAINING_STEPS
    return {"seconds_per_step": seconds, "peak_rss_mb": peak_rss_mb(), "rss_before_training_mb": before}


def photo_crops(size: int) -> Any:
    """CROPS random crops (and mirror images) of matplotlib's sample photos at size px, pixel / 255, (N, 3, H, W);
    the first is Grace Hopper's whole photo."""
    import matplotlib
    import numpy as np
    from PIL import Image

    folder = Path(matplotlib.get_data_path()) / "sample_data"
    photos = [
        Image.open(folder / name).convert("RGB") for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png")
    ]
    rng, crops = np.random.default_rng(0), [photos[0]]
    while len(crops) < CROPS:
        photo = photos[len(crops) % 2]
        side = int(min(photo.size) * rng.uniform(0.4, 0.9))
        left, top = (int(rng.integers(0, extent - side + 1)) for extent in photo.size)
        crop = photo.crop((left, top, left + side, top + side))
        crops.append(crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop)
    arrays = [np.asarray(c.resize((size, size), Image.Resampling.BICUBIC), np.float32) / 255 for c in crops]
    return np.ascontiguousarray(np.stack(arrays).transpose(0, 3, 1, 2))


def export_bundle(size: int, classes: list[str], out: Path) -> Path:
    """The pretrained spec's initial model at size px as a bundle with an int8 prefix calibrated on odd crops."""
    from edge_agent.learning.models import get_weights
    from edge_agent.learning.pretrained_backbone import initial_model
    from export.bundle_writer import Int8Data, write_bundle
    from protocol.model_spec import ModelSpec

    spec = ModelSpec(**SPEC_VALUES, height=size, width=size, class_names=classes, pretrained="imagenet")
    crops = photo_crops(size)
    write_bundle(get_weights(initial_model(spec, seed=0)), out, spec, int8_data=Int8Data(crops[1::2], crops[::2]))
    return out


def int8_agreement(size: int, out: Path) -> dict[str, Any]:
    """The ImageNet model's fp32 and int8 prefixes on the even crops (held out from calibration): top-1 agreement,
    the features' cosine, class 652's probability for the whole sample photo."""
    import numpy as np
    import onnxruntime as ort

    from edge_agent.learning.bundle import load_bundle
    from export.quantize import deterministic_probabilities

    bundle = load_bundle(export_bundle(size, [f"n{i}" for i in range(1000)], out))
    check = photo_crops(size)[::2]
    tail = bundle.graph_path("fp32", "tail")
    found: dict[str, Any] = {"check_images": len(check), **(bundle.manifest.quantization or {})}
    features = {}
    for precision in ("fp32", "int8"):
        prefix = bundle.graph_path(precision, "prefix")
        probabilities = deterministic_probabilities(prefix, tail, bundle.mask_shapes, check)
        found[f"photo_class_{precision}"] = int(probabilities[0].argmax())
        found[f"photo_p652_{precision}"] = float(probabilities[0, 652])
        session = ort.InferenceSession(str(prefix), providers=["CPUExecutionProvider"])
        features[precision] = session.run(None, {"images": check})[0]
    cosine = np.sum(features["fp32"] * features["int8"], 1) / (
        np.linalg.norm(features["fp32"], axis=1) * np.linalg.norm(features["int8"], axis=1)
    )
    return found | {"feature_cosine_mean": float(cosine.mean()), "feature_cosine_min": float(cosine.min())}


def in_subprocess(case: dict[str, Any]) -> dict[str, Any]:
    """One measurement in a fresh process (its own peak RSS), as JSON on its stdout."""
    result = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"case {case} failed: {result.stderr[-2000:]}")
    return {**case, **json.loads(result.stdout)}


def baseline_rss() -> dict[str, float]:
    """Peak RSS of a process that only imports numpy + onnxruntime, and one that imports torch too."""
    return {
        name: in_subprocess({"kind": "imports", "modules": modules})["peak_rss_mb"]
        for name, modules in (("numpy_onnxruntime", ["numpy", "onnxruntime"]), ("torch", ["numpy", "torch"]))
    }


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every case of the run, sizes outermost, progress on stderr."""
    inference, training, agreement = [], [], {}
    for size in args.sizes:
        bundle = export_bundle(size, CLASSES, work / f"bundle-{size}")
        agreement[size] = int8_agreement(size, work / f"imagenet-{size}")
        for precision, name in (("fp32", "prefix.onnx"), ("int8", "prefix.int8.onnx")):
            for threads in args.threads:
                case = {"kind": "inference", "size": size, "precision": precision, "threads": threads}
                inference.append(in_subprocess({**case, "graph": str(bundle / name), "seconds": args.seconds}))
                print(f"inference {case}: {inference[-1]['images_per_second']:.1f}/s", file=sys.stderr, flush=True)
        for trainable in args.trainable:
            for batch in args.batches:
                case = {"kind": "training", "size": size, "trainable": trainable, "batch": batch, "threads": 2}
                training.append(in_subprocess(case))
                print(f"training {case}: {training[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    for row in inference:
        row.pop("graph")
    return {"inference": inference, "training": training, "int8_agreement": agreement}


def fits(result: dict[str, Any]) -> dict[str, Any]:
    """Per device profile: the sizes whose onnxruntime prefix (int8 and fp32, 2 threads) and, for a torch trainer,
    the last:N training cases fit its memory budget."""
    from edge_agent.loop.profile import load_profile

    table = {}
    for path in sorted((ROOT / "firmware_configs").glob("*.toml")):
        profile = load_profile(path)
        budget = profile.memory_budget_mb
        row: dict[str, Any] = {"memory_budget_mb": budget, "trainer": profile.trainer}
        for precision in ("int8", "fp32"):
            row[f"inference_{precision}"] = sorted(
                {r["size"] for r in result["inference"] if r["precision"] == precision and r["peak_rss_mb"] <= budget}
            )
        row["training"] = sorted(
            {(r["size"], r["trainable"], r["batch"]) for r in result["training"] if r["peak_rss_mb"] <= budget}
        )
        table[profile.name] = row
    return table


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """The measurement a subprocess makes."""
    if case["kind"] == "imports":
        for module in case["modules"]:
            __import__(module)
        return {"peak_rss_mb": peak_rss_mb()}
    return inference_case(case) if case["kind"] == "inference" else training_case(case)


def main() -> None:
    """Runs every case (or one, with --case) and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--trainable", nargs="+", default=["last:1", "last:2", "last:4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seconds", type=float, default=4.0, help="time per inference case (at most 50 batches)")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    with tempfile.TemporaryDirectory() as temp:
        result = {"baseline_rss_mb": baseline_rss(), **measure(args, Path(temp))}
    result["fits"] = fits(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
