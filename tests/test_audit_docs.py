"""The documents name what exists: files, config keys, the checkpoint registry and the sample settings that README.md,
ARCHITECTURE.md and BENCHMARKS.md name are those of the code (statements drift; these are the ones a test can pin)."""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "bertrain"
DOCS = ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md")


def text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_architecture_tree_names_existing_modules() -> None:
    """Every module the ARCHITECTURE.md tree names (its first column) exists under src/bertrain."""
    tree = text("ARCHITECTURE.md").split("```\nsrc/bertrain/\n", 1)[1].split("```", 1)[0]
    named = [m.group(1) for m in re.finditer(r"^  (\S+?\.py|\S+/)\s", tree, flags=re.M)
             if not m.group(1).startswith("(")]
    assert len(named) > 40
    missing = [n for n in named if not (SRC / n).exists()]
    assert not missing, missing


def test_readme_layout_paths_exist() -> None:
    layout = text("README.md").split("\n## Layout\n", 1)[1]
    rows = re.findall(r"^\| `([^`]+)`(?:, `([^`]+)`)? \|", layout, flags=re.M)
    paths = [p for row in rows for p in row if p]
    assert "src/bertrain/deploy/" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_checkpoint_registry_is_the_one_the_documents_list() -> None:
    """ARCHITECTURE.md lists the registry's entries (training engine) and train_state.pt's keys (checkpoint folders)."""
    from bertrain.train import states
    source = inspect.getsource(states.training_states)
    registry = re.findall(r'"(\w+)":', source.split("return", 1)[1])
    doc = text("ARCHITECTURE.md")
    listed = re.search(r"`training_states\(\.\.\.\)` -> `\{([^}]*)\}`", doc)
    assert listed, "the registry line of ARCHITECTURE.md"
    assert re.findall(r'"(\w+)"', listed.group(1)) == registry
    pickled = [n for n in registry if n not in states.TENSOR_STATES]
    section = doc.split("## Checkpoint folders", 1)[1].split("## ", 1)[0]
    for name in pickled + ["optimizer"]:  # the optimizer is in train_state.pt under DDP
        assert f"`{name}`" in section, name


def test_sample_config_signature_in_architecture() -> None:
    from bertrain.data.samples import SampleConfig
    doc = text("ARCHITECTURE.md").replace("\n  ", " ")
    sig = re.search(r"`samples\.SampleConfig\(([^)]*)\)`", doc)
    assert sig
    documented = dict(kv.strip().split("=") for kv in sig.group(1).split(","))
    actual = {f.name: repr(f.default) for f in dataclasses.fields(SampleConfig)}
    assert documented == actual


def field_names(cls: type, prefix: str = "") -> set[str]:
    """Dotted names of a config dataclass's keys, its sections' keys included."""
    out = set()
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            out |= field_names(kind, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


SECTIONS = ("train", "optim", "schedule", "precision", "distributed", "parallelism", "checkpoint", "eval", "metrics",
            "profile", "model_options", "sample", "model", "data")


@pytest.mark.parametrize("doc", DOCS)
def test_dotted_config_keys_exist(doc: str) -> None:
    """A `section.key` in backticks names an engine config key (or a moved one, read under its old name)."""
    from bertrain.config import MOVED_KEYS
    from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig
    from bertrain.tasks.pretraining import PretrainConfig
    keys = set(MOVED_KEYS)
    for cls in (PretrainConfig, GlueFinetuneConfig, SquadFinetuneConfig):
        keys |= field_names(cls)
    named = {m for m in re.findall(r"`([a-z_]+\.[a-z_]+)(?:[:=][^`]*)?`", text(doc)) if m.split(".")[0] in SECTIONS}
    modules = {"metrics.jsonl", "metrics.png", "checkpoint.seed_rank_rng", "checkpoint.seed_micro_batch",
               "checkpoint.use_deterministic_kernels", "distributed.same_paths_on_every_rank",
               "distributed.store_wait", "train.resume",
               "model.loading_info", "model.tokenizer_files"}  # modules, functions and attributes, not keys
    unknown = sorted(named - keys - modules)
    assert not unknown, unknown
