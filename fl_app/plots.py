"""PNG plots of a run's metrics.jsonl.

Headless and free of global state: a bare matplotlib `Figure` renders through the Agg canvas,
so no pyplot backend is switched and no figure registry is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["round"]), float(r[key])) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_validation(
    metrics_jsonl: Path,
    out_png: Path,
    val_key: str = "val_success",
    train_key: str = "train_success",
    title: str | None = None,
    outcome_prefix: str = "val_outcome_",
) -> Path:
    """Validation success per round (rounds without validation are skipped), plus train success
    when the file has it; below it, when the rows carry outcome shares (`<outcome_prefix><label>`),
    how the validation episodes ended, stacked per round. Raises ValueError when there is
    nothing to plot."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    vx, vy = _series(rows, val_key)
    if not vx:
        raise ValueError(f"{metrics_jsonl} has no {val_key!r} values to plot; check the metric name")
    tx, ty = _series(rows, train_key)
    validated = [r for r in rows if r.get(val_key) is not None]
    labels = sorted({k.removeprefix(outcome_prefix) for r in validated for k in r if k.startswith(outcome_prefix)})
    labels.sort(key=lambda label: (label != "won", -sum(r.get(outcome_prefix + label, 0.0) for r in validated)))
    fig = Figure(figsize=(7, 6.8 if labels else 4.2), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2)) if labels else [fig.subplots()]
    ax = axes[0]
    ax.plot(vx, vy, marker="o", label=f"validation ({val_key})")
    if tx:
        ax.plot(tx, ty, marker=".", alpha=0.7, label=f"train ({train_key})")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title or f"Success per round: {Path(metrics_jsonl).parent.name}")
    if labels:  # a label absent from a row is a share of 0 (rollout.outcome_shares)
        bottom = [0.0] * len(vx)
        for label in labels:
            share = [r.get(outcome_prefix + label, 0.0) for r in validated]
            axes[1].bar(vx, share, bottom=bottom, width=0.8, label=label)
            bottom = [b + v for b, v in zip(bottom, share)]
        axes[1].set_ylabel("validation episodes")
        axes[1].set_ylim(0, 1)
        axes[1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", title="outcome")
    axes[-1].set_xlabel("federated round (0 = initial model)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def plot_seed_bands(arms: dict[str, list[Path]], out_png: Path, key: str = "val_success", title: str = "") -> Path:
    """Per arm (label -> the metrics.jsonl of its seeds): the mean over seeds per round and a band
    from the lowest to the highest seed, so two arms are compared against their seed noise.
    Raises ValueError when an arm has no run or its runs validated different rounds."""
    fig = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, paths in arms.items():
        series = [_series([json.loads(x) for x in Path(p).read_text().splitlines() if x.strip()], key) for p in paths]
        if not series or any(s[0] != series[0][0] or not s[0] for s in series):
            raise ValueError(f"arm {label!r}: need >= 1 run, all with {key!r} on the same rounds ({paths})")
        ys = [s[1] for s in series]
        lo, hi = [min(v) for v in zip(*ys)], [max(v) for v in zip(*ys)]
        mean = [sum(v) / len(v) for v in zip(*ys)]
        (line,) = ax.plot(series[0][0], mean, marker="o", label=f"{label} (mean of {len(paths)} seeds)")
        ax.fill_between(series[0][0], lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("federated round (0 = initial model)")
    ax.set_ylabel(key.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title or f"{key}: mean over seeds, band = seed min..max")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png
