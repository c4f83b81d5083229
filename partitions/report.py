"""Realized heterogeneity of a recipe's partition: `partition.json` for a run, and a command that
prints the same without running anything.

    python -m partitions.report tiny-shop-preference                       # the recipe as is
    python -m partitions.report tiny-shop-preference partition.params.omega=0.01 --png omega001.png
    python -m partitions.report webshop-grpo-qwen2.5-1.5b-coverage-xi1 \\
        --counts beauty=198,electronics=180,fashion=5012,garden=905,grocery=115   # a stand-in pool

The server calls `write_partition_report(run_dir, cfg)` once, before round 1: it builds the
training pool from the env (read-only), computes every client's shard, refuses labels that do
not match (partitions/labels.py), refuses to resume a run dir whose partition.json names another
partition, writes partition.json and returns the headline figures for summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fl_app.config import Config, cli_config
from partitions.env_realized import format_report as format_env_report
from partitions.env_realized import realized_env_heterogeneity
from partitions.labels import FORMAT, Labels, LabelsError
from partitions.pool import TaskPool, build_pool, pool_from_counts
from partitions.realized import client_rows, closed_forms, realized
from partitions.registry import PartitionPlan, plan_partition

REPORT_FILE = "partition.json"


class PartitionMismatch(RuntimeError):
    """A run dir being resumed was partitioned differently."""


def describe(plan: PartitionPlan, cfg: Config) -> dict[str, Any]:
    """The partition.json body: what was asked, the pool, per-client rows, realized vs closed form."""
    rows = client_rows(plan)
    doc: dict[str, Any] = {
        "partition": {
            "name": plan.name,
            "params": plan.params,
            "seed": plan.seed,
            "clients": len(plan.shards),
            "tasks_per_client": cfg.federation.tasks_per_client,
        },
        "pool": {
            "env": plan.pool.env,
            "size": len(plan.pool),
            "categories": plan.pool.category_counts(),
            "fingerprint": plan.pool.fingerprint,
        },
        "digest": plan.digest(),
        "realized": realized(plan, rows),
        "closed_form": closed_forms(plan, cfg),
    }
    if plan.labels is not None and plan.match is not None:
        doc["labels"] = {"path": plan.labels.path, "provenance": plan.labels.provenance, **plan.match.as_dict()}
    doc["clients"] = rows
    return doc


PER_CLIENT = ("variant_hashes", "variant_of_client")  # partition.json only, not summary.json


def headline(doc: dict[str, Any]) -> dict[str, Any]:
    """The summary.json entry: everything but the per-client rows and maps."""
    out = {k: v for k, v in doc.items() if k != "clients"}
    if "env_partition" in doc:
        out["env_partition"] = {k: v for k, v in doc["env_partition"].items() if k not in PER_CLIENT}
    return out


def write_partition_report(run_dir: Path, cfg: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Compute the run's partition once, write `partition.json`, return its headline figures."""
    plan = plan_partition(cfg, build_pool(cfg.env.name, cfg.env.params))
    path = Path(run_dir) / REPORT_FILE
    if path.exists():
        before = json.loads(path.read_text()).get("digest")
        if before != plan.digest():
            raise PartitionMismatch(
                f"{path} records partition digest {str(before)[:12]}, but this config computes {plan.digest()[:12]}: "
                "resuming would train later rounds on other shards. Resume with the original partition settings "
                "(and labels), or start a fresh run.run_dir"
            )
    doc = describe(plan, cfg)
    if cfg.env_partition.name != "uniform":  # each client's env variant, as its lane will serve it
        doc["env_partition"] = realized_env_heterogeneity(cfg, expert=False, shard_of=plan.shard)
    doc["written"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    lines = format_report(doc).splitlines()
    if "env_partition" in doc:
        lines += [
            "  env variants: " + line.removeprefix("- ")
            for line in format_env_report(doc["env_partition"]).splitlines()
        ]
    for line in lines:
        log(line)
    return headline(doc)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_report(doc: dict[str, Any]) -> str:
    part, pool, real, closed = doc["partition"], doc["pool"], doc["realized"], doc["closed_form"]
    knobs = ", ".join(f"{k}={v}" for k, v in part["params"].items()) or "no knobs"
    lines = [
        (
            f"partition {part['name']} ({knobs}; seed {part['seed']}): {part['clients']} clients over "
            f"{pool['size']} {pool['env']} training tasks {pool['categories']}"
        ),
        "  realized: " + ", ".join(f"{k} {_fmt(v)}" for k, v in real.items()),
        "  closed form: " + ", ".join(f"{k} {_fmt(v)}" for k, v in closed.items() if not isinstance(v, dict)),
    ]
    if "pi" in closed:
        lines.append("  pi: " + ", ".join(f"{c} {v:.3f}" for c, v in closed["pi"].items()))
    if "labels" in doc:
        lab = doc["labels"]
        prov = lab["provenance"]
        lines.append(
            f"  labels {lab['path']}: {lab['easy']} easy / {lab['hard']} hard; {lab['misses']} of "
            f"{pool['size']} training tasks have no label ({lab['miss_fraction']:.1%}, counted hard); "
            f"made {prov.get('date', '?')} with weights {str(prov.get('weights_sha256', '?'))[:12]}, "
            f"{prov.get('rollout_mode')} mode, T={prov.get('temperature')}, seed {prov.get('seed')}"
        )
    lines.append(f"  digest {doc['digest'][:16]}")
    return "\n".join(lines)


def plot_partition(doc: dict[str, Any], out_png: Path, title: str = "") -> Path:
    """Clients x categories heatmap of the mixtures (with easy fraction when labelled) + size histogram."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = doc["clients"]
    names = list(doc["pool"]["categories"])
    sizes = np.array([r["size"] for r in rows], dtype=float)
    mix = np.array([[r["categories"][c] for c in names] for r in rows], dtype=float) / sizes[:, None]
    cols = names + (["easy"] if "easy" in rows[0] else [])
    if "easy" in rows[0]:
        mix = np.hstack([mix, (np.array([r["easy"] for r in rows]) / sizes)[:, None]])
    fig = Figure(figsize=(8, 3.6), dpi=80)
    FigureCanvasAgg(fig)
    ax_map, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.3, 1]})
    im = ax_map.imshow(mix, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax_map.set_xticks(range(len(cols)), [c[:12] for c in cols], rotation=45, ha="right", fontsize=7)
    ax_map.set_ylabel("client")
    ax_map.set_title("share of each client's shard", fontsize=9)
    fig.colorbar(im, ax=ax_map, fraction=0.05)
    if sizes.min() == sizes.max():  # every shard the same size: one bar, not a zero-width bin
        ax_hist.bar([sizes[0]], [len(sizes)], width=2, color="tab:blue")
        ax_hist.set_xlim(sizes[0] - 10, sizes[0] + 10)
    else:
        ax_hist.hist(sizes, bins=min(30, len(set(sizes.tolist()))), color="tab:blue")
    ax_hist.set_xlabel("shard size (tasks)")
    ax_hist.set_ylabel("clients")
    ax_hist.set_title("shard sizes", fontsize=9)
    part = doc["partition"]
    knobs = ", ".join(f"{k}={v}" for k, v in part["params"].items())
    fig.suptitle(title or f"{part['name']} ({knobs}) on {doc['pool']['env']}: {doc['pool']['size']} tasks", fontsize=10)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png", pil_kwargs={"optimize": True})
    return out_png


def synthetic_labels(pool: TaskPool, fraction: float, rollout_mode: str, seed: int = 0) -> Labels:
    """Seeded random success labels at `fraction`, for looking at a hardness partition's shape on a
    pool no reference policy has labelled (report only; a run always uses real labels)."""
    rng = np.random.default_rng(seed)
    ok = rng.random(len(pool)) < fraction
    prov = {
        "env": pool.env,
        "env_fingerprint": pool.fingerprint,
        "rollout_mode": rollout_mode,
        "synthetic": f"random labels at success rate {fraction} (seed {seed})",
        "weights_sha256": "none",
        "temperature": None,
        "seed": seed,
        "date": "n/a",
        "format": FORMAT,
    }
    return Labels(f"<synthetic {fraction}>", prov, {t: bool(v) for t, v in zip(pool.task_ids, ok)})


def _parse_counts(text: str) -> dict[str, int]:
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--counts wants category=count pairs separated by commas, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Print a recipe's partition (realized heterogeneity next to the closed "
        "forms) and write a PNG (clients x categories heatmap + size "
        "histogram). Builds the env's training pool; runs nothing."
    )
    ap.add_argument("recipe", help="recipe name in configs/ or a YAML path")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. partition.params.omega=0.01")
    ap.add_argument("--png", type=Path, default=None, help="where to write the PNG (default: <recipe>-partition.png)")
    ap.add_argument("--json", type=Path, default=None, help="also write the partition.json body here")
    ap.add_argument(
        "--counts",
        default="",
        help="a stand-in pool with these category counts instead of the env "
        "(e.g. a published pool whose data is not here): cat=n,cat=n,...",
    )
    ap.add_argument(
        "--synthetic-labels",
        type=float,
        default=None,
        metavar="RATE",
        help="random success labels at RATE instead of partition.labels (hardness shape only)",
    )
    args = ap.parse_args(argv)
    dotlist = list(args.overrides)
    if args.synthetic_labels is not None:
        dotlist.append("partition.labels=<synthetic>")
    if (cfg := cli_config(args.recipe, dotlist)) is None:
        return 2
    pool = pool_from_counts(_parse_counts(args.counts)) if args.counts else build_pool(cfg.env.name, cfg.env.params)
    try:
        if args.synthetic_labels is not None:
            labels = synthetic_labels(pool, args.synthetic_labels, cfg.rollout.mode)
            plan = plan_partition(cfg, pool, labels)
        else:
            plan = plan_partition(cfg, pool)
    except (LabelsError, ValueError) as e:
        print(f"partition: {e}", file=sys.stderr)
        return 2
    doc = describe(plan, cfg)
    print(format_report(doc))
    png = plot_partition(doc, args.png or Path(f"{Path(args.recipe).stem}-partition.png"))
    print(f"  wrote {png}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
