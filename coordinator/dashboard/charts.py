# The report's charts as PNG bytes, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot).
from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

DPI = 100
SUSPECT_COLOUR = "#b42318"


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
    for device in sorted({d for r in rounds for d in r["device_accuracy"]}):
        points = [(r["round"], r["device_accuracy"][device]) for r in rounds if device in r["device_accuracy"]]
        axes.plot(*zip(*points), "--", marker=".", label=device)
    axes.set(xlabel="round", ylabel="test accuracy", ylim=(0, 1), title="Accuracy per round")
    round_axis(axes.xaxis, [r["round"] for r in rounds])
    axes.legend(fontsize="small", ncol=4)
    axes.grid(alpha=0.3)
    return png_bytes(figure)


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
    devices, layers = view["devices"], view["layers"]
    values = np.array([[np.nan if v is None else v for v in row] for row in view["values"]], dtype=float)
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
    axes.set_title(f"Per-layer divergence, round {view['round']}")
    return png_bytes(figure)


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
    series = {"aggregate": view["aggregate"], **view["devices"]}
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
