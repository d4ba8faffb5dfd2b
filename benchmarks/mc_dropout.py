# MC-dropout scoring speed and memory: a naive torch loop against the project's torch and onnxruntime back ends.
"""Prints one JSON object. Every row runs in its own subprocess (so peak RSS is per row) on the same pool,
bundle and settings: 4000 Fashion-MNIST training images, the paper CNN with a briefly trained W0 (one Adam
epoch over 10000 training images disjoint from the pool), T=20 passes, entropy, top-400, 2 threads.
The onnxruntime rows run through `edge-agent score`'s code path in a process that never imports torch, at the
back end's default batch; their peak RSS is checked against issue #3's target (RSS_TARGET_MB).

The `zoo` section does the same for every model of the zoo (a seeded, untrained model: speed does not depend on the
weights) on ZOO_POOL random images of the model's input shape: the naive loop against the project's onnxruntime
scorer on the same model, each in its own process, with images/s, peak RSS and the prefix cache's speed-up.

With `--trees NAME=DIR ...` it compares checkouts instead: the `--rows` (default: onnxruntime int8, batch 256) on one
bundle and pool (built by the first tree, the oldest), each row run with each tree's own code, interleaved `--repeats` times, with every tree's speed
against the first's paired by repeat (how wave 4 told a slower scorer from a busier machine)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from load import add_trees_option

POOL_SIZE = 4000
PASSES = 20
TOP = 400
THREADS = 2
NAIVE_BATCH = 256
RSS_TARGET_MB = 120


def train_w0(out: Path | str) -> dict:
    """Trains W0 briefly, exports it as a bundle with an int8 prefix, writes the pool shard; returns the manifest."""
    import numpy as np
    import torch

    from bench.shard import Shard, save_shard
    from edge_agent.data.fashion_mnist import load_fashion_mnist
    from edge_agent.data.image_arrays import model_input
    from edge_agent.learning.models import build_model, get_weights
    from export.bundle_writer import Int8Data, write_bundle

    out = Path(out)
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    data = load_fashion_mnist()
    model = build_model(seed=0)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.from_numpy(model_input(data.train_images[POOL_SIZE : POOL_SIZE + 10000]))
    labels = torch.from_numpy(data.train_labels[POOL_SIZE : POOL_SIZE + 10000].astype(np.int64))
    model.train()
    for start in range(0, len(images), 64):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(images[start : start + 64]), labels[start : start + 64]).backward()
        optimiser.step()
    save_shard(out / "pool.npz", Shard(data.train_images[:POOL_SIZE], data.train_labels[:POOL_SIZE].astype(np.int64)))
    int8_data = Int8Data(
        model_input(data.train_images[POOL_SIZE : POOL_SIZE + 512]),
        model_input(data.test_images),
        data.test_labels.astype(np.int64),
    )
    return write_bundle(get_weights(model), out / "bundle", int8_data=int8_data).to_json()


ZOO_POOL = 400
ZOO_CLASSES = ["boot", "bag", "shirt", "trouser", "dress"]
ZOO = {
    "paper-cnn-28-grey": {},
    "rgb-cnn-64": {"architecture": "rgb-cnn", "channels": 3, "height": 64, "width": 64},
    "mobilenet-0.25-96": {
        "architecture": "mobilenet",
        "channels": 3,
        "height": 96,
        "width": 96,
        "width_multiplier": 0.25,
    },
    "mobilenet-1.0-96": {"architecture": "mobilenet", "channels": 3, "height": 96, "width": 96},
    "mobilenet-1.0-224": {"architecture": "mobilenet", "channels": 3, "height": 224, "width": 224},
}
"""Zoo rows: model spec fields (colour models get 5 classes and mean 0.5 / std 0.25 per channel)."""


def zoo_inputs(out: Path | str, name: str) -> None:
    """The zoo model's bundle (seeded weights) and a pool of random uint8 images of its shape, under out/name."""
    import numpy as np

    from edge_agent.learning.models import build_model, get_weights
    from export.bundle_writer import write_bundle
    from protocol.model_spec import ModelSpec

    out, fields = Path(out), ZOO[name]
    colour = {"mean": [0.5] * 3, "std": [0.25] * 3, "class_names": ZOO_CLASSES} if fields else {}
    spec = ModelSpec(**{**colour, **fields})
    write_bundle(get_weights(build_model(spec, seed=0)), out / name / "bundle", spec)
    pool = np.random.default_rng(0).integers(0, 256, (ZOO_POOL, *spec.image_shape), dtype=np.uint8)
    np.save(out / name / "pool.npy", pool)


def naive_row(out: Path, pool_file: str = "pool.npz") -> dict:
    """model.train() and T full forward passes over the pool in batches of 256, mean softmax, entropy, top-k."""
    import resource
    import time

    import numpy as np
    import torch

    from edge_agent.data.image_arrays import model_input
    from edge_agent.learning.acquisition_scores import entropy_scores, top_k
    from edge_agent.learning.bundle import load_bundle
    from edge_agent.learning.models import build_model, set_weights
    from edge_agent.score_command import load_pool_images
    from protocol.files import load_arrays

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    spec = load_bundle(out / "bundle").manifest.spec
    model = build_model(spec)
    set_weights(model, load_arrays(out / "bundle" / "weights.npz"))
    images = torch.from_numpy(model_input(np.asarray(load_pool_images(out / pool_file, None, spec.image_shape))))
    started = time.perf_counter()
    model.train()
    passes = []
    with torch.no_grad():
        for _ in range(PASSES):
            passes.append(
                torch.cat(
                    [torch.softmax(model(images[i : i + NAIVE_BATCH]), -1) for i in range(0, len(images), NAIVE_BATCH)]
                ).numpy()
            )
    selected = top_k(entropy_scores(np.stack(passes)), TOP)
    seconds = time.perf_counter() - started
    return {
        "backend": "naive-torch",
        "images": len(images),
        "seconds": round(seconds, 3),
        "images_per_second": round(len(images) / seconds, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "indices": selected.tolist(),
    }


def scorer_row(out: Path, backend: str, precision: str, batch: int, pool_file: str = "pool.npz") -> dict:
    """The project's scorer exactly as `edge-agent score` runs it."""
    from edge_agent.score_command import score_pool

    return score_pool(
        out / "bundle",
        out / pool_file,
        PASSES,
        TOP,
        "entropy",
        backend=backend,
        batch_size=batch,
        threads=THREADS,
        precision=precision,
    )


ROWS = {
    "naive-torch": ("naive", "", 0),
    "torch": ("scorer", "torch fp32", 256),
    "onnxruntime-fp32": ("scorer", "onnxruntime fp32", 64),
    "onnxruntime-int8": ("scorer", "onnxruntime int8", 64),
    "onnxruntime-int8-batch256": ("scorer", "onnxruntime int8", 256),
}


THIS_TREE = Path(__file__).resolve().parents[1]


def run_row(out: Path, name: str, *extra: str, tree: Path = THIS_TREE) -> dict:
    """Measures one row in a fresh interpreter, with `tree`'s code (its own copy of this script), and returns its JSON
    record (with torch_imported)."""
    return in_tree(tree, str(tree / "benchmarks" / "mc_dropout.py"), "--row", name, "--dir", str(out), *extra)


def in_tree(tree: Path, *arguments: str) -> Any:
    """The JSON a fresh interpreter prints when it runs `arguments` in `tree`, with that tree's code first on the
    path (before what PYTHONPATH already names)."""
    result = subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))},
    )
    return json.loads(result.stdout)


def compare_trees(out: Path, trees: list[tuple[str, Path]], rows: list[str], repeats: int) -> dict:
    """The same rows on the same bundle and pool (built by the first tree: the oldest, whose bundle every later tree
    reads) with each tree's code, interleaved `repeats` times so that a drift of the machine falls on every tree
    alike; each tree's speed against the first tree's, paired by repeat."""
    in_subprocess("train_w0", out, tree=trees[0][1])
    speeds: dict[str, dict[str, list[float]]] = {row: {name: [] for name, _ in trees} for row in rows}
    for _ in range(repeats):
        for row in rows:
            for name, tree in trees:
                speeds[row][name].append(run_row(out, row, tree=tree)["images_per_second"])
    baseline = trees[0][0]
    summary = {}
    for row, by_tree in speeds.items():
        summary[row] = {
            name: {
                "images_per_second": values,
                "mean": round(statistics.mean(values), 1),
                f"paired_ratio_vs_{baseline}": [round(v / b, 3) for v, b in zip(values, by_tree[baseline])],
            }
            for name, values in by_tree.items()
        }
    return {"trees": {name: str(tree) for name, tree in trees}, "repeats": repeats, "rows": summary}


def in_subprocess(function: str, *args: object, tree: Path = THIS_TREE) -> Any:
    """Calls one of this module's functions (`tree`'s copy of it) in a fresh interpreter and returns its JSON result.
    The inputs are built there so that this process stays small: a child's peak RSS counts the parent's pages it
    forked from."""
    call = f"{function}(*{[str(arg) if isinstance(arg, Path) else arg for arg in args]!r})"
    code = (
        f"import json, sys; sys.path.insert(0, {str(tree / 'benchmarks')!r}); import mc_dropout; "
        f"from pathlib import Path; print(json.dumps(mc_dropout.{call}))"
    )
    return in_tree(tree, "-c", code)


def zoo_section(out: Path) -> dict:
    """Per zoo model: the naive loop and the onnxruntime fp32 scorer (prefix once, tail T times) on its own pool."""
    section = {}
    for name in ZOO:
        in_subprocess("zoo_inputs", out, name)
        naive = run_row(out / name, "naive-torch", "--pool-file", "pool.npy")
        scored = run_row(out / name, "onnxruntime-fp32", "--pool-file", "pool.npy")
        section[name] = {
            "parameters_mb": round((out / name / "bundle" / "weights.npz").stat().st_size / 1e6, 2),
            "naive_images_per_second": naive["images_per_second"],
            "naive_peak_rss_mb": naive["peak_rss_mb"],
            "images_per_second": scored["images_per_second"],
            "peak_rss_mb": scored["peak_rss_mb"],
            "prefix_cache_speedup": round(scored["images_per_second"] / naive["images_per_second"], 2),
            "torch_imported_when_scoring": scored["torch_imported"],
        }
    return section


def summary_of(rows: dict[str, dict], quantization: dict, zoo: dict) -> dict:
    """The printed comparison: every row with its speed-up over the naive loop, the top-400 overlaps, the zoo."""
    naive = rows["naive-torch"]["images_per_second"]
    selections = {name: set(row.pop("indices")) for name, row in rows.items()}
    for row in rows.values():
        row["speedup_vs_naive"] = round(row["images_per_second"] / naive, 2)
    names = list(rows)
    overlap = {f"{a} vs {b}": len(selections[a] & selections[b]) for i, a in enumerate(names) for b in names[i + 1 :]}
    within_naive_rss = [row for row in rows.values() if row["peak_rss_mb"] <= rows["naive-torch"]["peak_rss_mb"]]
    return {
        "pool": POOL_SIZE,
        "passes": PASSES,
        "top": TOP,
        "sampler": "entropy",
        "threads": THREADS,
        "weights": "W0: 1 Adam epoch (lr 1e-3, batch 64) on 10000 training images not in the pool",
        "int8": quantization,
        "rows": list(rows.values()),
        "zoo": zoo,
        "top400_overlap": overlap,
        "best_speedup": max(row["speedup_vs_naive"] for row in rows.values()),
        "best_speedup_within_naive_rss": max(row["speedup_vs_naive"] for row in within_naive_rss),
        "rss_target_mb": RSS_TARGET_MB,
        "onnxruntime_rows_within_rss_target": [
            name for name, row in rows.items() if name.startswith("onnxruntime") and row["peak_rss_mb"] <= RSS_TARGET_MB
        ],
    }


def main() -> None:
    """Builds the shared inputs once, then measures every row side by side and prints the comparison."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", choices=ROWS)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--pool-file", default="pool.npz")
    parser.add_argument("--zoo-only", action="store_true", help="only the zoo section")
    add_trees_option(parser, "compare these checkouts' scorers row by row (the first is the baseline)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=["onnxruntime-int8-batch256"], help="with --trees")
    parser.add_argument("--repeats", type=int, default=5, help="with --trees: interleaved runs of each row and tree")
    args = parser.parse_args()
    if args.row:
        kind, spec, batch = ROWS[args.row]
        pool = args.pool_file
        record = naive_row(args.dir, pool) if kind == "naive" else scorer_row(args.dir, *spec.split(), batch, pool)
        record.update(row=args.row, batch=batch or NAIVE_BATCH, torch_imported="torch" in sys.modules)
        print(json.dumps(record))
        return
    with tempfile.TemporaryDirectory() as temp:
        out = Path(temp)
        if len(args.trees) > 1:
            print(json.dumps(compare_trees(out, args.trees, args.rows, args.repeats), indent=1))
            return
        zoo = zoo_section(out)
        if args.zoo_only:
            print(json.dumps({"pool": ZOO_POOL, "passes": PASSES, "threads": THREADS, "zoo": zoo}, indent=1))
            return
        quantization = in_subprocess("train_w0", out)["quantization"]
        rows = {name: run_row(out, name) for name in ROWS}
    print(json.dumps(summary_of(rows, quantization, zoo), indent=1))


if __name__ == "__main__":
    main()
