"""The README's commands stay true: every `bertrain …` line in its bash blocks parses (subcommand and options
exist), and every `pretrain` line's config and dotted overrides load strictly."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bertrain.cli import build_parser
from bertrain.config import load_config, overrides_from_args

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    cmds = []
    for line in lines:
        line = line.split(" #")[0].strip()
        if line.startswith("#"):
            continue
        for part in re.split(r"&&|\|", line):
            words = shlex.split(part)
            for i, w in enumerate(words):
                if w == "bertrain":
                    cmds.append(words[i + 1:])
                elif w == "-m" and i + 1 < len(words) and words[i + 1] == "bertrain":
                    cmds.append(words[i + 2:])
    return cmds


def test_readme_has_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "bertrain run configs/recipes/pydoc-small.yaml" in text  # the main job: raw text to evaluated model
    assert "bertrain pretrain --config configs/quickstart.yaml" in text  # pretraining alone
    # CI runs the README's test command (the same pytest options)
    test_command = "-m pytest -q -n 2 --dist loadfile tests"
    assert f"python {test_command}" in text
    assert test_command in (README.parent / ".ci" / "run").read_text()


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_parses(argv: list[str]) -> None:
    args = build_parser(argv).parse_args(argv)
    assert args.command == argv[0]
    if argv[0] == "pretrain":
        from bertrain.tasks.pretraining import PretrainConfig
        cfg = load_config(PretrainConfig, README.parent / args.config, overrides_from_args(args))
        assert cfg.train.steps > 0
    if argv[0] == "run":  # the recipe loads strictly and every stage's engine config builds
        from bertrain.pipeline.recipe import load_recipe
        from bertrain.pipeline.stages import build_stages
        assert build_stages(load_recipe(README.parent / args.recipe, args.overrides))
