# The report's charts as PNG bytes, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot).
from __future__ import annotations

import io
from collections.abc import Collection

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

DPI = 100
SUSPECT_COLOUR = "#b42318"
MAX_HEATMAP_DEVICES = 40  # more rows are unreadable, and at a thousand devices the image alone took about 1 GB
MAX_DEVICE_SERIES = 12  # more devices are drawn as their median (and spread), not one line or bar each


def device_series(per_device: dict[str, list]) -> dict[str, list]:
    """Each device's per-class accuracies, or, beyond MAX_DEVICE_SERIES devices, their per-class median."""
    if len(per_device) <= MAX_DEVICE_SERIES:
        return per_device
    table = np.array([[np.nan if a is None else a for a in row] for row in per_device.values()], dtype=float)
    medians = [
        float(np.median(column[np.isfinite(column)])) if np.isfinite(column).any() else None for column in table.T
    ]
    return {f"median of {len(per_device)} devices": medians}


def png_bytes(figure: Figure) -> bytes:
    """The figure rendered by the Agg canvas as PNG."""
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def new_figure(width: float, height: float) -> Figure:
    """A figure of width x height inches with tight layout."""
    return Figure(figsize=(width, height), dpi=DPI, layout="tight")


def round_axis(axis, round_ids: list[int]) -> None:
    """Whole-number round ticks with half a round of margin, also for a single round."""
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axis.set_view_interval(min(round_ids) - 0.5, max(round_ids) + 0.5, ignore=True)


def accuracy_chart(rounds: list[dict]) -> bytes:
    """Global test accuracy per round (solid) with each device's local accuracy before aggregation (dashed)."""
    figure = new_figure(7, 3.6)
    axes = figure.add_subplot()
    scored = [r for r in rounds if r["accuracy"] is not None]
    axes.plot([r["round"] for r in scored], [r["accuracy"] for r in scored], "o-", color="black", lw=2, label="global")
    devices = sorted({d for r in rounds for d in r["device_accuracy"]})
    if len(devices) > MAX_DEVICE_SERIES:
        device_spread(axes, rounds, len(devices))
    else:
        for device in devices:
            points = [(r["round"], r["device_accuracy"][device]) for r in rounds if device in r["device_accuracy"]]
            axes.plot(*zip(*points), "--", marker=".", label=device)
    axes.set(xlabel="round", ylabel="test accuracy", ylim=(0, 1), title="Accuracy per round")
    round_axis(axes.xaxis, [r["round"] for r in rounds])
    axes.legend(fontsize="small", ncol=4)
    axes.grid(alpha=0.3)
    return png_bytes(figure)


def device_spread(axes, rounds: list[dict], count: int) -> None:
    """The devices' local accuracies per round as their median (dashed) inside their min-max band."""
    scored = [r for r in rounds if r["device_accuracy"]]
    accuracies = [np.array(list(r["device_accuracy"].values()), dtype=float) for r in scored]
    x = [r["round"] for r in scored]
    axes.fill_between(
        x, [a.min() for a in accuracies], [a.max() for a in accuracies], alpha=0.2, label="devices' range"
    )
    axes.plot(x, [float(np.median(a)) for a in accuracies], "--", marker=".", label=f"median of {count} devices")


def labels_chart(rounds: list[dict]) -> bytes:
    """Global test accuracy against the labels used so far: the active-learning curve."""
    figure = new_figure(7, 3.6)
    axes = figure.add_subplot()
    scored = [r for r in rounds if r["accuracy"] is not None]
    axes.plot([r["labels"] for r in scored], [r["accuracy"] for r in scored], "o-", color="black", lw=2)
    axes.set(xlabel="labels used", ylabel="test accuracy", ylim=(0, 1), title="Accuracy against labels used")
    axes.grid(alpha=0.3)
    return png_bytes(figure)


def divergence_heatmap(view: dict) -> bytes:
    """Devices x layers relative divergence of the round (the paper's Figure 10); suspects' outlier layers boxed."""
    layers, every_device = view["layers"], view["devices"]
    every_value = np.array([[np.nan if v is None else v for v in row] for row in view["values"]], dtype=float)
    rows = heatmap_rows(every_value, every_device, view["suspects"])
    devices, values = [every_device[row] for row in rows], every_value[rows]
    figure = new_figure(max(6.0, 0.6 * len(layers) + 2.5), 1.6 + 0.45 * len(devices))
    axes = figure.add_subplot()
    finite = np.where(np.isfinite(values), values, np.nan)
    image = axes.imshow(finite, aspect="auto", cmap="Blues")
    figure.colorbar(image, ax=axes, label="||W_i - W_agg|| / ||W_i||")
    axes.set_xticks(range(len(layers)), layers, rotation=60, ha="right", fontsize="small")
    axes.set_yticks(range(len(devices)), [f"{d} (suspect)" if d in view["suspects"] else d for d in devices])
    for label, device in zip(axes.get_yticklabels(), devices):
        if device in view["suspects"]:
            label.set_color(SUSPECT_COLOUR)
    for row, device in enumerate(devices):
        for layer in view["suspects"].get(device, []):
            if layer in layers:
                axes.add_patch(
                    Rectangle((layers.index(layer) - 0.5, row - 0.5), 1, 1, fill=False, edgecolor=SUSPECT_COLOUR, lw=2)
                )
    shown = "" if len(rows) == len(every_device) else f" ({len(rows)} of {len(every_device)}: suspects, most divergent)"
    axes.set_title(f"Per-layer divergence, round {view['round']}{shown}")
    return png_bytes(figure)


def heatmap_rows(
    values: np.ndarray, devices: list[str], suspects: Collection[str], limit: int = MAX_HEATMAP_DEVICES
) -> list[int]:
    """The rows the heatmap draws, in the view's order: every one up to `limit`; beyond it the suspects first, then
    the devices whose largest layer divergence is highest."""
    if len(devices) <= limit:
        return list(range(len(devices)))
    largest = np.where(np.isfinite(values), values, -np.inf).max(axis=1, initial=-np.inf)
    ranked = sorted(range(len(devices)), key=lambda row: (devices[row] not in suspects, -largest[row], row))
    return sorted(ranked[:limit])


def timeline_chart(rounds: list[dict]) -> bytes:
    """One bar per round from its start to its close, annotated with accepted/quorum, stragglers and rejections."""
    figure = new_figure(7, 2.0 + 0.35 * len(rounds))
    axes = figure.add_subplot()
    origin = rounds[0]["started_at"] if rounds else 0.0
    for r in rounds:
        colour = SUSPECT_COLOUR if r["rejected"] or r["stragglers"] else "#3b6fd8"
        axes.barh(r["round"], r["seconds"], left=r["started_at"] - origin, color=colour, height=0.6)
        notes = (
            [f"{r['accepted']}/{r['quorum']}"]
            + ([f"stragglers {','.join(r['stragglers'])}"] if r["stragglers"] else [])
            + ([f"rejected {r['rejected']}"] if r["rejected"] else [])
        )
        axes.text(r["closed_at"] - origin, r["round"], "  " + "  ".join(notes), va="center", fontsize="small")
    axes.set(xlabel="seconds since the first round opened", ylabel="round", title="Round timeline")
    axes.margins(x=0.25)
    round_axis(axes.yaxis, [r["round"] for r in rounds])
    axes.invert_yaxis()
    return png_bytes(figure)


def class_accuracy_chart(view: dict) -> bytes:
    """Per-class test accuracy of the aggregate and of each device model, side by side (the paper's Figure 11)."""
    series = {"aggregate": view["aggregate"], **device_series(view["devices"])}
    classes = view["classes"]
    figure = new_figure(8, 3.6)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(series))
    for index, (name, accuracies) in enumerate(series.items()):
        heights = [np.nan if a is None else a for a in accuracies]
        axes.bar(
            np.arange(len(classes)) + index * width - 0.4 + width / 2,
            heights,
            width,
            label=name,
            color="black" if name == "aggregate" else None,
        )
    axes.set_xticks(range(len(classes)), [str(c) for c in classes])
    axes.set(
        xlabel="class",
        ylabel="test accuracy",
        ylim=(0, 1),
        title=f"Per-class accuracy, round {view['round']}: devices against the aggregate",
    )
    axes.legend(fontsize="small", ncol=4)
    return png_bytes(figure)
