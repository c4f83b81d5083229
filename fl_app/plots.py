"""PNG plots of a run's metrics.jsonl.

Headless and free of global state: a bare matplotlib `Figure` renders through the Agg canvas,
so no pyplot backend is switched and no figure registry is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fl_app.accounting import PHASES, phases_of
from fl_app.outcomes import outcome_shares_of


def _rows(metrics_jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["round"]), float(r[key])) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_validation(
    metrics_jsonl: Path,
    out_png: Path,
    val_key: str = "val_success",
    train_key: str = "train_success",
    title: str | None = None,
    outcome_prefix: str = "val_",
) -> Path:
    """Validation success per round (rounds without validation are skipped), plus train success
    when the file has it; below it, when the rows carry outcome shares under `outcome_prefix`
    (fl_app/outcomes.py), how the validation episodes ended, stacked per round. Raises ValueError
    when there is nothing to plot."""
    rows = _rows(metrics_jsonl)
    vx, vy = _series(rows, val_key)
    if not vx:
        raise ValueError(f"{metrics_jsonl} has no {val_key!r} values to plot; check the metric name")
    tx, ty = _series(rows, train_key)
    shares = [outcome_shares_of(r, outcome_prefix) for r in rows if r.get(val_key) is not None]
    fig = Figure(figsize=(7, 6.8 if any(shares) else 4.2), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2)) if any(shares) else [fig.subplots()]
    ax = axes[0]
    ax.plot(vx, vy, marker="o", label=f"validation ({val_key})")
    if tx:
        ax.plot(tx, ty, marker=".", alpha=0.7, label=f"train ({train_key})")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title or f"Success per round: {Path(metrics_jsonl).parent.name}")
    if any(shares):
        _outcome_bars(axes[1], vx, shares)
    axes[-1].set_xlabel("federated round (0 = initial model)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, out_png)


def plot_phases(metrics_jsonl: Path, out_png: Path, title: str | None = None) -> Path:
    """Where each round's wall time went: its phases (`phase_s`, fl_app.accounting) stacked per
    round in the order they happen, `other` on top; a row from before `phase_s` shows what its
    fit sums name. Raises ValueError when no round has phases (only round 0)."""
    timed = [(int(r["round"]), p) for r in _rows(metrics_jsonl) if (p := phases_of(r)) is not None]
    if not timed:
        raise ValueError(f"{metrics_jsonl} has no round with phase times (round 0 has none); run a round first")
    rounds = [rnd for rnd, _ in timed]
    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bottom = [0.0] * len(rounds)
    for phase in (*PHASES, "other"):
        height = [max(p.get(phase, 0.0), 0.0) for _, p in timed]
        if any(height):
            ax.bar(rounds, height, bottom=bottom, width=0.8, label=phase)
            bottom = [b + h for b, h in zip(bottom, height)]
    ax.set_xlabel("federated round")
    ax.set_ylabel("seconds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", title="phase")
    ax.set_title(title or f"Wall time per round by phase: {Path(metrics_jsonl).parent.name}")
    return _save(fig, out_png)


def _save(fig: Figure, out_png: Path) -> Path:
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def _outcome_bars(ax: Axes, rounds: list[int], shares: list[dict[str, float]]) -> None:
    """Per round, the outcome shares stacked, `won` at the bottom, the rest by overall share; a
    label a round lacks is 0 there."""
    total = {label: sum(s.get(label, 0.0) for s in shares) for label in {k for s in shares for k in s}}
    labels = sorted(total, key=lambda k: (k != "won", -total[k], k))
    bottom = [0.0] * len(rounds)
    for label in labels:
        height = [s.get(label, 0.0) for s in shares]
        ax.bar(rounds, height, bottom=bottom, width=0.8, label=label)
        bottom = [b + h for b, h in zip(bottom, height)]
    ax.set_ylabel("validation episodes")
    ax.set_ylim(0, 1)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", title="outcome")


def plot_seed_bands(arms: dict[str, list[Path]], out_png: Path, key: str = "val_success", title: str = "") -> Path:
    """Per arm (label -> the metrics.jsonl of its seeds): the mean over seeds per round and a band
    from the lowest to the highest seed, so two arms are compared against their seed noise.
    Raises ValueError when an arm has no run or its runs validated different rounds."""
    fig = Figure(figsize=(7, 4.2 + 0.25 * len(arms)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, paths in arms.items():
        series = [_series(_rows(p), key) for p in paths]
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
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small")  # below: labels can be long
    ax.set_title(title or f"{key}: mean over seeds, band = seed min..max")
    return _save(fig, out_png)
