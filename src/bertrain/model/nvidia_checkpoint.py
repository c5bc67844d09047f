"""Checkpoints of NVIDIA's DeepLearningExamples BERT for PyTorch, read without unpickling code, under HF's names.

What NVIDIA's code does (NVIDIA/DeepLearningExamples, PyTorch/LanguageModeling/BERT: modeling.py, run_pretraining.py,
run_squad.py, run_glue.py, read at 1d4211fe (2020-11; its modeling.py is 482fe9ac of 2020-09) and at master 729963dd
(2024-04; its modeling.py is a9e2c1d5 of 2022-03, the scripts of 2022-06)):

* Files. run_pretraining.py saves `ckpt_<step>.pt` by torch.save: until 2020 {'model': model.state_dict(),
  'optimizer', 'master params' (apex amp's fp32 copies), 'files', 'epoch', 'data_loader'}, where 'data_loader' is
  the DataLoader object itself, pickled with the dataset and worker-init classes of run_pretraining.py's
  `__main__` (None only at the last step); since 2022 {'model', 'optimizer', 'grad_scaler', 'epoch'}. run_squad.py
  and run_glue.py save {"model": model.state_dict()} as pytorch_model.bin beside the config they built the model
  from (bert_config.json until 2020, config.json since), and read a checkpoint as `checkpoint["model"] if "model"
  in checkpoint.keys() else checkpoint` (so do NGC's downloads, bert_pyt_ckpt_*: inference.py reads a fine-tuned
  one as `torch.load(...)["model"]`). Every script saves `model.module if hasattr(model, 'module') else model`, so
  NVIDIA's own files have no `module.` prefix (a state dict saved from a DDP or DataParallel wrapper does).
* Names. HF's BERT names, but `dense_act` for the LinearActivation (a Linear fused with its activation) of
  BertIntermediate, BertPooler and BertPredictionHeadTransform: `bert.encoder.layer.N.intermediate.dense_act.*`,
  `bert.pooler.dense_act.*`, `cls.predictions.transform.dense_act.*`. LayerNorms (`weight`/`bias`) and the heads
  are HF's: cls.predictions (`decoder` tied to the word embeddings, `bias`), cls.seq_relationship, qa_outputs,
  classifier.
* Vocabulary. Every script pads the config before building the model (`if config.vocab_size % 8 != 0:
  config.vocab_size += 8 - (config.vocab_size % 8)`), so the word embeddings, the MLM decoder and its bias have
  that many rows (30528 for vocab.txt's 30522), and run_squad.py / run_glue.py write the padded vocab_size into the
  config they save.
* Activation. "gelu" is `bias_gelu`, x * 0.5 * (1 + erf(x / 1.41421)) until 2020: the exact GELU (HF's and
  bertrain's "gelu") up to the constant; since a9e2c1d5 (2022) it is `F.gelu(x, approximate=True)`, the tanh
  approximation in the NGC 21.11 container its Dockerfile names (HF's and bertrain's "gelu_new"). The pooler's is
  tanh and LayerNorm's eps 1e-12, as bertrain's; the attention mask adds -10000 where bertrain leaves padded keys
  out, the same in float32 (exp(-10000) is 0).

What is done here, in small pure functions that hf.py calls (`weights_files`, `_load_weights_file`,
`load_pretrained`): `checkpoint_file` finds the one `*.pt` of a folder; `load_file` loads any PyTorch pickle with
`torch.load(weights_only=True)` only, refusing a file holding other objects with one line and a command that
extracts the weights from a file the user trusts (unpickling runs code the file names); `bert_state_dict` takes the
state dict from 'model' (or the file itself), strips `module.`, renames `dense_act` -> `dense` and slices the padded
vocabulary rows to the real vocabulary, refusing rows that NVIDIA's padding does not explain; `vocab_size` and
`hidden_act` decide the config the weights need.
"""
from __future__ import annotations

import json
import logging
import pickle
import re
import shlex
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SUFFIX = ".pt"  # run_pretraining.py's ckpt_<step>.pt, NGC's bert_*_qa.pt / bert_*_pretrained*.pt
BERTRAIN_STATE = "train_state.pt"  # bertrain's own training state (train/checkpoint.py) is never model weights
MODEL = "model"  # the key under which every NVIDIA script saves the state dict
EXTRACTED = "pytorch_model.bin"  # where the extraction command writes (a folder's pytorch_model.bin is read first)
PADDING_MULTIPLE = 8
SINCE_2022 = "grad_scaler"  # an entry only run_pretraining.py of 2022 and later saves (native AMP's GradScaler)
UNTIL_2020 = "master params"  # an entry only run_pretraining.py of 2020 and earlier saves (apex amp)
_VOCAB_ROWS = ("embeddings.word_embeddings.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
               "cls.predictions.bias")
_DENSE_ACT = re.compile(r"(^|\.)dense_act\.")
_MODULE = "module."


@dataclass(frozen=True)
class Checkpoint:
    """The weights of an NVIDIA checkpoint file under HF's names, and the names of its other entries (which say
    what wrote it: see `hidden_act`)."""
    tensors: dict[str, torch.Tensor]
    saved: tuple[str, ...]


# ----------------------------------------------------------------------------------------------- the folder

def checkpoint_file(folder: Path) -> Path | None:
    """The folder's one `*.pt` file (bertrain's own train_state.pt aside), or None. Several are an error listing
    them: which one is the model is the user's choice, not the newest step's."""
    found = sorted(p for p in folder.glob(f"*{SUFFIX}") if p.is_file() and p.name != BERTRAIN_STATE)
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:8]) + (f", ... ({len(found) - 8} more)" if len(found) > 8 else "")
        raise ValueError(f"{folder}: holds {len(found)} PyTorch checkpoints ({names}) and bertrain reads one: move "
                         f"the others out of the folder, or rename the one to use to {EXTRACTED} (which is read "
                         "first)")
    return found[0] if found else None


def padded(vocab_size: int) -> int:
    """The rows NVIDIA's scripts give a vocabulary of `vocab_size` tokens: the next multiple of 8."""
    return -(-vocab_size // PADDING_MULTIPLE) * PADDING_MULTIPLE


def vocab_size(config_vocab_size: int, vocab_lines: int | None) -> int:
    """The real vocabulary of an NVIDIA model: the config's vocab_size, but vocab.txt's size where the config says
    exactly its padding (run_squad.py and run_glue.py save the config after padding it)."""
    if vocab_lines is not None and vocab_lines < config_vocab_size == padded(vocab_lines):
        return vocab_lines
    return config_vocab_size


def hidden_act(config_act: str, saved: Collection[str]) -> tuple[str, str]:
    """(the hidden_act that computes what NVIDIA's code computed for a file holding the entries `saved`, why). Only
    "gelu" changed meaning (module docstring); other activations, and a config's explicit "gelu_new", are kept."""
    if config_act != "gelu":
        return config_act, ""
    if SINCE_2022 in saved:
        return "gelu_new", (f"it holds '{SINCE_2022}', so NVIDIA's run_pretraining.py of 2022 or later wrote it, "
                            "whose modeling.py computes \"gelu\" as the tanh approximation: using \"gelu_new\"")
    if UNTIL_2020 in saved:
        return "gelu", (f"it holds '{UNTIL_2020}', so NVIDIA's run_pretraining.py of 2020 or earlier wrote it, whose "
                        "modeling.py computes \"gelu\" with erf: using \"gelu\" (the exact GELU)")
    return "gelu", ("it does not say which NVIDIA code wrote it (run_squad.py, run_glue.py and NGC's files hold only "
                    "'model'): using \"gelu\", the exact erf GELU of NVIDIA's modeling.py until 2020; for a model "
                    "trained with its code of 2022 or later (the tanh approximation) set \"hidden_act\": "
                    "\"gelu_new\" in the config")


# ----------------------------------------------------------------------------------------------- the file

def load_file(f: Path) -> Any:
    """The object a PyTorch pickle (`.pt`, `.bin`) holds, loaded with `weights_only=True` and nothing else:
    tensors, dicts, lists, numbers and strings. A file holding other objects is refused (`refusal`), never
    unpickled; a damaged one is one line naming it."""
    # A run_pretraining.py checkpoint also holds the optimizer state and apex's fp32 master copy (about 4x the
    # weights): memory-mapped, what is not used stays on disk. Only the zip format (torch >= 1.6) can be mapped.
    mmap = f.suffix == SUFFIX and zipfile.is_zipfile(f)
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(f, str(e))
        if unsafe:
            raise ValueError(refusal(f, unsafe)) from None
        raise ValueError(f"{f}: cannot read weights: {_first_line(str(e))}") from None
    except Exception as e:  # truncated or damaged: name the file
        raise ValueError(f"{f}: cannot read weights: {_first_line(str(e))}") from None


def _first_line(message: str) -> str:
    """The part of torch's (multi-line) message that says what is wrong."""
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", message)
    return (m[1] if m else message.strip().split("\n")[0]).strip()


def _unsafe_globals(f: Path, error: str) -> list[str]:
    """The classes and functions the file's pickle names that weights_only refuses: for the zip format every one,
    found by disassembling its data.pkl (nothing is run); for the old format the one torch's error names."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch >= 2.5
    if find is not None and zipfile.is_zipfile(f):
        try:
            return list(find(f))
        except Exception:  # damaged: fall back to what the error says
            pass
    return re.findall(r"GLOBAL ([\w.]+) was not an allowed global", error)


def refusal(f: Path, unsafe: list[str]) -> str:
    """One line: why `f` is not loaded, and the command that extracts its weights where the user trusts it."""
    unsafe = sorted(set(unsafe))  # `__main__.` first: the classes of the script that saved it
    shown = ", ".join(unsafe[:6]) + (f", ... ({len(unsafe) - 6} more)" if len(unsafe) > 6 else "")
    out = f.with_name(EXTRACTED if f.name != EXTRACTED else "pytorch_model.weights.bin")
    then = (f"it writes {out.name} beside it, which bertrain then reads" if out.name == EXTRACTED
            else f"then replace {f.name} with the {out.name} it writes")
    return (f"{f}: holds pickled Python objects besides tensors ({shown}), which bertrain does not unpickle: "
            "unpickling runs code that the file names (NVIDIA's run_pretraining.py of 2020 pickles its DataLoader "
            f"into every checkpoint but the last); if you trust the file, extract its weights with: "
            f"{extract_command(f, out, unsafe)} ({then})")


def extract_command(f: Path, out: Path, unsafe: list[str]) -> str:
    """A shell command that unpickles `f` (the user's choice, for a file they trust) and saves only its tensors under
    'model' to `out`. Classes pickled from a script's `__main__` (run_pretraining.py's pretraining_dataset and
    WorkerInitObj) exist in no importable module: stand-ins take their place, as nothing is done with them."""
    stand_ins = [g.split(".", 1)[1] for g in unsafe if g.startswith("__main__.") and g.split(".", 1)[1].isidentifier()]
    define = " = ".join(dict.fromkeys(stand_ins)) + ' = type("Unpickled", (), {}); ' if stand_ins else ""
    code = (f"import torch; {define}c = torch.load({json.dumps(str(f))}, map_location=\"cpu\", weights_only=False); "
            "m = c.get(\"model\", c); torch.save({\"model\": {k: v for k, v in m.items() if isinstance(v, "
            f"torch.Tensor)}}}}, {json.dumps(str(out))})")
    return f"python -c {shlex.quote(code)}"


# ----------------------------------------------------------------------------------------------- the weights

def is_nvidia(obj: Any) -> bool:
    """Whether a loaded pytorch_model.bin is NVIDIA's rather than HF's: the state dict under 'model' (as every
    NVIDIA script saves it), or NVIDIA's `dense_act` names."""
    if not isinstance(obj, Mapping):
        return False
    return isinstance(obj.get(MODEL), Mapping) or any(isinstance(k, str) and _DENSE_ACT.search(k) for k in obj)


def bert_state_dict(obj: Any, f: Path, vocab: int, vocab_from: str) -> Checkpoint:
    """The weights of the loaded NVIDIA checkpoint `obj` (of file `f`) under HF's names, their vocabulary rows
    sliced to `vocab` tokens (`vocab_from` says where that number comes from, for errors)."""
    state, saved = model_state(obj, f)
    if saved:
        log.info("%s: using its '%s' weights; ignoring %s (training state, not weights)", f, MODEL,
                 ", ".join(repr(k) for k in saved))
    return Checkpoint(vocab_rows(hf_names(state, f), vocab, f, vocab_from), saved)


def model_state(obj: Any, f: Path) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """(the state dict: `obj['model']`, or `obj` itself when it is one, the names of `obj`'s other entries)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{f}: holds a {type(obj).__name__}, not a checkpoint of NVIDIA's BERT scripts (a dict with "
                         f"the model's state dict under '{MODEL}', or a state dict)")
    if MODEL in obj:
        state, saved, what = obj[MODEL], tuple(str(k) for k in obj if k != MODEL), f"its '{MODEL}' entry"
        if not isinstance(state, Mapping):
            raise ValueError(f"{f}: {what} is a {type(state).__name__}, not a state dict")
    else:
        state, saved, what = obj, (), "it"
    wrong = [repr(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if wrong:
        raise ValueError(f"{f}: {what} is not a model state dict ({', '.join(wrong[:5])}"
                         f"{' ...' if len(wrong) > 5 else ''} {'is' if len(wrong) == 1 else 'are'} not tensors); "
                         f"NVIDIA's scripts save the state dict under '{MODEL}'")
    return dict(state), saved


def hf_names(state: Mapping[str, torch.Tensor], f: Path) -> dict[str, torch.Tensor]:
    """NVIDIA's names -> HF's: `module.` prefixes (DDP/DataParallel) stripped, `dense_act` -> `dense`."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, t in state.items():
        name = key
        while name.startswith(_MODULE):
            name = name[len(_MODULE):]
        name = _DENSE_ACT.sub(r"\1dense.", name)
        if name in out:
            raise ValueError(f"{f}: both {origin[name]} and {key} are {name}; is this one model's state dict?")
        out[name], origin[name] = t, key
    return out


def vocab_rows(state: dict[str, torch.Tensor], vocab: int, f: Path, vocab_from: str) -> dict[str, torch.Tensor]:
    """`state` with its vocabulary rows (word embeddings, MLM decoder and bias) cut to the `vocab` real tokens:
    rows as many as NVIDIA's padding gives (`padded`) are sliced; fewer than `vocab`, or more than that padding
    explains, mean weights and config are not one model's, and are refused."""
    out = dict(state)
    for key, t in state.items():
        if not any(key == k or key.endswith("." + k) for k in _VOCAB_ROWS) or t.dim() == 0:
            continue
        rows = t.shape[0]
        if rows == vocab:
            continue
        if rows == padded(vocab):
            out[key] = t[:vocab]
        elif rows < vocab:
            raise ValueError(f"{f}: {key} has {rows} rows, fewer than the {vocab} tokens of the vocabulary "
                             f"({vocab_from}): the weights are of a model with a smaller vocabulary; use the "
                             "bert_config.json and vocab.txt it was trained with")
        else:
            raise ValueError(f"{f}: {key} has {rows} rows, but NVIDIA's scripts pad a vocabulary of {vocab} tokens "
                             f"({vocab_from}) to {padded(vocab)} (a multiple of {PADDING_MULTIPLE}): the weights "
                             "and the config do not belong together; use the bert_config.json and vocab.txt the "
                             "model was trained with")
    return out
