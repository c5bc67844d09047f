"""`bertrain run RECIPE [--dry-run] [--set KEY=VALUE ...] [--overwrite]`: the whole pipeline, as stages.

vocabulary -> prepare -> pretrain phase 1 -> phase 2 -> fine-tune each task (and seed) -> evaluate -> report, each
stage in its own folder of the run folder, skipped when complete and unchanged, resumed when interrupted, redone
(with every stage after it) when its settings or inputs changed — see `bertrain.pipeline.stages`. Runs under
torchrun / srun / mpirun unchanged. Run it again after any stop (kill -9 included) to continue.
"""
from __future__ import annotations

import argparse
import logging

HELP = "run a recipe end to end: vocab, prepare, pretrain phase 1/2, fine-tune, evaluate, report (resumable stages)"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe YAML (e.g. configs/recipes/pydoc-small.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the stages and which would run, be resumed, redone or skipped, and why; do nothing")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key (dotted, YAML value), e.g. --set phase1.train.steps=20 or "
                             "--set 'finetune[0].seeds=[1]'; repeatable")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over: the existing run folder is moved aside to NAME.replaced-<time> first")


def run(args: argparse.Namespace) -> int:
    from bertrain.pipeline.recipe import load_recipe
    from bertrain.pipeline.stages import build_stages, check_settings, format_plan, plan, run_stages
    from bertrain.train.launch import launch_env

    recipe = load_recipe(args.recipe, args.overrides)
    stages = build_stages(recipe)  # every engine config is built here: a bad key stops us before any work
    if args.dry_run:
        check_settings(recipe, stages)  # what the real run would refuse before any work (missing inputs: listed)
        layout = launch_env()
        if layout is None or layout.rank == 0:
            print(format_plan(stages, plan(stages), recipe.run_dir))
        return 0
    decisions = run_stages(recipe, stages, overwrite=args.overwrite)
    if decisions:
        ran = [n for n, d in decisions.items() if d.action != "skip"]
        log.info("done: %d stages run, %d skipped; report: %s", len(ran), len(decisions) - len(ran),
                 recipe.run_dir / "report" / "report.html")
    return 0
