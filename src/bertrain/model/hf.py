"""Hugging Face format is bertrain's exchange format: one key map for both directions, plus folder I/O.

bertrain's parameter names are HF's, except that query/key/value are one fused Linear and the vocabulary rows
are padded to a multiple of 8. So the whole key map (torchtitan's "state dict adapter" idea) is two rules:

    <prefix>attention.self.qkv.{weight,bias}  <->  <prefix>attention.self.{query,key,value}.{weight,bias}
    embeddings.word_embeddings.weight, cls.predictions.bias: padded rows  <->  the first vocab_size rows

`to_hf_state_dict` / `from_hf_state_dict` apply them to any dict of tensors (parameters, or their gradients).
Around them: config.json in both directions, reading HF folders written by any transformers version or converted
from Google's checkpoints (`bert.` prefix or not, heads or not, `.safetensors` or `.bin`, sharded or not, TF-style
`gamma`/`beta`), reading Google's original TensorFlow checkpoints themselves (bert_config.json + `*.ckpt.index` /
`.data-*`, through `bertrain.model.tf_checkpoint`, with Google's tanh GELU kept: `google_activation`) and the
checkpoints of NVIDIA's PyTorch BERT (`ckpt_<step>.pt`, NGC's `*.pt`, run_squad/run_glue's nested pytorch_model.bin,
through `bertrain.model.nvidia_checkpoint`: `nvidia_config`), and writing folders that `transformers` loads without
a missing-weight warning.

A model is named by a folder or by a Hub model id (`ORG/NAME`, optionally `@REVISION`), which `resolve_model_dir`
finds in the local Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME`; the snapshot layout
`models--ORG--NAME/snapshots/<commit>/`, `refs/<branch>`); nothing is downloaded, so it works with HF_HUB_OFFLINE=1.
That lookup is the one use of `huggingface_hub` here (the optional extra `bertrain[hub]`), imported only then.

This module imports `bertrain.model.bert`, never the reverse: the model knows nothing about files. The model
classes' `from_pretrained` / `save_pretrained` methods are `load_pretrained` / `save_pretrained` below, installed
on `BertPreTrainedModel` at the end of this module (`bertrain.model` imports it, so any model import has them).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors, save as save_safetensors
from torch import nn

from bertrain.model import nvidia_checkpoint, tf_checkpoint
from bertrain.model.bert import (
    MODEL_CLASSES,
    BertConfig,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertModel,
    BertPreTrainedModel,
)
from bertrain.utils.errors import UserError
from bertrain.utils.io import atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

CONFIG_NAMES = ("config.json", "bert_config.json")  # HF, then Google's original release
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH_BIN, PYTORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json",
                   "added_tokens.json")
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]"}

_QKV = ".attention.self.qkv."
_QKV_PARTS = (".attention.self.query.", ".attention.self.key.", ".attention.self.value.")
_VOCAB_ROWS = ("embeddings.word_embeddings.weight", "cls.predictions.bias")
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")  # HF buffers, not weights
_TIED_DECODER = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")  # = word embeddings / bias
_BASE_ROOTS = ("embeddings.", "encoder.", "pooler.")
# A Hub model id, as the Hub spells them ("bert-base-uncased", "google-bert/bert-base-uncased"), with an optional
# "@revision" (a branch, tag or commit); anything else (two slashes, "./x", "/x", "~/x") is only ever a path.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[\w./-]+))?")
_HUB_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)(?:--(?P<name>[^/]+))?/snapshots/[^/]+/?$")
HUB_EXTRA = 'pip install "bertrain[hub]"'
# Groups of keys a checkpoint may lack; reported by name when initialised.
HEADS = {"pooler": "pooler.", "MLM head": "cls.predictions.", "NSP head": "cls.seq_relationship.",
         "classification head": "classifier.", "QA head": "qa_outputs."}


# ----------------------------------------------------------------------------------------------- config.json

def config_from_hf_dict(data: dict[str, Any]) -> BertConfig:
    """A `BertConfig` from a config.json-style dict: known fields are taken, HF bookkeeping keys ignored, and keys
    that would change the architecture into something this model is not (another model_type, relative positions,
    a decoder) are rejected."""
    if data.get("model_type", "bert") != "bert":
        raise ValueError(f"model_type = {data['model_type']!r}: only 'bert' models are supported")
    if data.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type = {data['position_embedding_type']!r}: only 'absolute'")
    for key in ("is_decoder", "add_cross_attention"):
        if data.get(key):
            raise ValueError(f"{key} = {data[key]!r}: only encoder BERT models are supported")
    if "embedding_size" in data and data["embedding_size"] != data.get("hidden_size"):
        raise ValueError(f"embedding_size = {data['embedding_size']!r}: factorised embeddings are not BERT")
    names = {f.name for f in dataclasses.fields(BertConfig)}
    return BertConfig(**{k: v for k, v in data.items() if k in names})


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of an HF or Google `config.json`; errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: config file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_from_json_file(path: str | os.PathLike) -> BertConfig:
    """Read an HF or Google `config.json` (unrelated keys such as `architectures` are ignored)."""
    return _config_of(path, read_config_json(path))


def _config_of(path: str | os.PathLike, data: dict[str, Any]) -> BertConfig:
    try:
        return config_from_hf_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def config_to_hf_dict(config: BertConfig, architectures: list[str] | None = None) -> dict[str, Any]:
    """The config.json that `transformers.BertConfig` reads (vocabulary padding is internal: not written)."""
    d: dict[str, Any] = {"architectures": architectures or ["BertForPreTraining"], "model_type": "bert"}
    d.update(dataclasses.asdict(config))
    del d["pad_vocab_size_multiple"]
    d.update(position_embedding_type="absolute", tie_word_embeddings=True)
    return d


# ----------------------------------------------------------------------------------------------- the key map

def _tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return obj.state_dict() if isinstance(obj, nn.Module) else obj


def _is_vocab_rows(key: str) -> bool:
    return any(key == k or key.endswith("." + k) for k in _VOCAB_ROWS)


def to_hf_state_dict(obj: nn.Module | Mapping[str, torch.Tensor],
                     config: BertConfig | None = None) -> dict[str, torch.Tensor]:
    """bertrain names -> HF names: split the fused QKV, slice the vocabulary padding off. `obj` is a model or any
    dict keyed like its state_dict (e.g. parameter gradients); the result holds views (clone before mutating)."""
    if config is None:
        if not isinstance(obj, BertPreTrainedModel):
            raise TypeError("to_hf_state_dict: pass `config` with a plain dict of tensors")
        config = obj.config
    out: dict[str, torch.Tensor] = {}
    for key, t in _tensors(obj).items():
        if _QKV in key:
            for part, chunk in zip(_QKV_PARTS, t.chunk(3, dim=0)):
                out[key.replace(_QKV, part)] = chunk
        elif _is_vocab_rows(key):
            out[key] = t[:config.vocab_size]
        else:
            out[key] = t
    return out


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """HF names -> bertrain names (the inverse of `to_hf_state_dict`): concatenate Q/K/V, zero-pad the vocabulary
    rows. Keys must already carry the target model's prefix (see `load_pretrained`)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in hf.items():
        if _QKV_PARTS[0] in key:
            parts = [key.replace(_QKV_PARTS[0], p) for p in _QKV_PARTS]
            missing = [p for p in parts if p not in hf]
            if missing:
                raise ValueError(f"{key} is present but {', '.join(missing)} is not")
            out[key.replace(_QKV_PARTS[0], _QKV)] = torch.cat([hf[p] for p in parts], dim=0)
        elif any(p in key for p in _QKV_PARTS[1:]):
            continue  # consumed with the query
        elif _is_vocab_rows(key):
            pad = config.padded_vocab_size - t.shape[0]
            out[key] = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
        else:
            out[key] = t
    return out


# ----------------------------------------------------------------------------------------------- Hub model ids

def split_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `name` reads as a Hub model id (`ORG/NAME`, `NAME`, `ORG/NAME@REVISION`),
    else None. Whether it *is* one is for `resolve_model_dir` to say: an existing path always wins."""
    m = _HUB_ID.fullmatch(name)
    if m is None or name.endswith((".json", ".txt", ".yaml", ".safetensors", ".bin")):
        return None
    return m["repo"], m["revision"]


def hub_id_of(path: str | os.PathLike) -> str | None:
    """The Hub model id of a folder in the HF cache layout (`.../models--ORG--NAME/snapshots/<commit>`), else None."""
    m = _HUB_SNAPSHOT.search(Path(path).as_posix())
    if m is None:
        return None
    return f"{m['org']}/{m['name']}" if m["name"] else m["org"]


def model_dir_or_name(name_or_path: str | os.PathLike) -> str:
    """`resolve_model_dir`'s folder, or `name_or_path` itself where it does not resolve here: what a rank compares
    with the other ranks' (`same_paths_on_every_rank`); loading the model names what is wrong."""
    try:
        return os.fspath(resolve_model_dir(name_or_path))
    except (ValueError, OSError):
        return os.fspath(name_or_path)


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """The folder of a model named by a path or a Hub model id.

    An existing path (or one that cannot be a Hub id) is returned as is: the caller's own error names what it
    misses. Otherwise `ORG/NAME[@REVISION]` is looked up in the local Hugging Face cache, never downloaded (works
    with HF_HUB_OFFLINE=1); absent, the error says how to fetch it."""
    path = Path(name_or_path)
    hub = None if path.exists() else split_hub_id(str(name_or_path))
    if hub is None:
        return path
    repo_id, revision = hub
    at = f" --revision {revision}" if revision else ""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise UserError(f"{name_or_path}: no such folder; to use it as a Hugging Face Hub model id (found in the local "
                        f"HF cache) install huggingface_hub: {HUB_EXTRA}") from None
    cache = constants.HF_HUB_CACHE
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise UserError(f"{name_or_path}: no such folder, and the Hub model {repo_id}"
                        f"{f' at revision {revision}' if revision else ''} is not in the local Hugging Face cache "
                        f"({cache}); fetch it once while online with `hf download {repo_id}{at}` (then it also loads "
                        "with HF_HUB_OFFLINE=1), or give a local model folder") from None
    except HFValidationError as e:
        raise UserError(f"{name_or_path}: no such folder, and not a valid Hub model id ({e})") from None
    if not any((snapshot / name).is_file() for name in CONFIG_NAMES):
        raise UserError(f"{name_or_path}: the local Hugging Face cache holds only part of {repo_id} ({snapshot} has "
                        f"no config.json); fetch the whole model with `hf download {repo_id}{at}`")
    log.info("%s: the Hub model in the local Hugging Face cache, %s", name_or_path, snapshot)
    return snapshot


# ----------------------------------------------------------------------------------------------- reading

def find_config_file(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder (expected an HF model folder with config.json)")
    for name in CONFIG_NAMES:
        if (path / name).is_file():
            return path / name
    raise ValueError(f"{path}: no config.json in this folder; an HF/bertrain model folder needs config.json "
                     f"(with the BERT sizes) beside model.safetensors or pytorch_model.bin")


def _load_weights_file(f: Path) -> dict[str, torch.Tensor]:
    return _read_weights_file(f)[0]


def _read_weights_file(f: Path) -> tuple[dict[str, torch.Tensor], tuple[str, ...] | None]:
    """(the tensors of one weight file under HF's names, the names of the file's other entries where it is a
    checkpoint of NVIDIA's scripts (`nvidia_checkpoint`), else None)."""
    if _is_tf_checkpoint(f):  # its errors name the file and what to do already
        return tf_checkpoint.load_bert_state_dict(f), None
    if f.suffix == ".safetensors":
        try:
            return load_safetensors(str(f)), None
        except Exception as e:  # corrupt/truncated files: name the file
            raise ValueError(f"{f}: cannot read weights: {e}") from None
    sd = nvidia_checkpoint.load_file(f)  # weights_only; its errors name the file and what to do
    if f.suffix == nvidia_checkpoint.SUFFIX or nvidia_checkpoint.is_nvidia(sd):
        ckpt = nvidia_checkpoint.bert_state_dict(sd, f, *_nvidia_vocab(f.parent))
        return ckpt.tensors, ckpt.saved
    if not isinstance(sd, dict):
        raise ValueError(f"{f}: expected a dict of tensors, got {type(sd).__name__}")
    return sd, None


def _nvidia_vocab(folder: Path) -> tuple[int, str]:
    """(the real vocabulary size of the NVIDIA model in `folder`, what says so): `nvidia_checkpoint.vocab_size` of
    its config and vocab.txt."""
    config_file = find_config_file(folder)
    config = _config_of(config_file, read_config_json(config_file))
    vocab = folder / "vocab.txt"
    n = nvidia_checkpoint.vocab_size(config.vocab_size, vocab_size_of(vocab.read_bytes()) if vocab.is_file() else None)
    return n, f"{vocab} has {n} tokens" if n != config.vocab_size else f"{config_file} says vocab_size = {n}"


def _is_tf_checkpoint(f: Path) -> bool:
    return f.name.endswith(tf_checkpoint.INDEX_SUFFIX)


def weights_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of an HF folder: model.safetensors, else pytorch_model.bin (or their sharded forms), else
    the `.index` file of a TensorFlow checkpoint (Google's original BERT layout; `tf_checkpoint.checkpoint_index`
    says which when there are several), else the one `*.pt` file of a checkpoint of NVIDIA's PyTorch BERT
    (`nvidia_checkpoint.checkpoint_file`: several are an error listing them). A pytorch_model.bin of NVIDIA's
    run_squad.py / run_glue.py ({"model": state dict}) is found as HF's and read as NVIDIA's."""
    path = Path(path)
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PYTORCH_BIN, PYTORCH_BIN_INDEX)):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path / index}: not a valid weights index: {e}") from None
            return [path / name for name in dict.fromkeys(weight_map.values())]
    index = tf_checkpoint.checkpoint_index(path) if path.is_dir() else None
    if index is not None:
        return [index]
    if (path / "dcp").is_dir():  # train/dcp.py's layout
        raise ValueError(f"{path}: a sharded (FSDP) checkpoint: its weights are DCP shards for resuming; "
                         f"`bertrain export {path} OUT_DIR` writes them as an HF model folder")
    nvidia = nvidia_checkpoint.checkpoint_file(path) if path.is_dir() else None
    if nvidia is not None:
        return [nvidia]
    raise ValueError(f"{path}: no weights found (expected {SAFETENSORS}, {PYTORCH_BIN}, a TensorFlow checkpoint "
                     "(*.ckpt.index with its .data-* files) or a checkpoint of NVIDIA's PyTorch BERT (*.pt))")


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's weight file(s), under the names stored there (Google's and NVIDIA's
    checkpoints: under HF's)."""
    return _read_weights(weights_files(path))[0]


def _read_weights(files: list[Path]) -> tuple[dict[str, torch.Tensor], tuple[str, ...] | None]:
    """(the tensors of the weight files, the other entries of an NVIDIA checkpoint among them or None)."""
    sd: dict[str, torch.Tensor] = {}
    saved: tuple[str, ...] | None = None
    for f in files:
        tensors, entries = _read_weights_file(f)
        sd.update(tensors)
        saved = entries if entries is not None else saved
    return sd, saved


def _normalize_keys(raw: Mapping[str, torch.Tensor], with_prefix: bool) -> dict[str, torch.Tensor]:
    """Bring checkpoint keys to HF's modern names for the target class: `bert.` prefix on the encoder keys iff the
    class has it, TF-style LayerNorm gamma/beta -> weight/bias, buffers dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        base = key[len("bert."):] if key.startswith("bert.") else key
        if base in _BUFFERS:
            continue
        if base.startswith(_BASE_ROOTS):
            key = "bert." + base if with_prefix else base
        out[key] = t
    return out


def vocab_size_of(vocab: bytes) -> int:
    """Lines of a vocab.txt (one token per line; only '\\n' separates, as HF's BertTokenizer reads it)."""
    text = vocab.decode("utf-8")
    return len(text.split("\n")) - (1 if text.endswith("\n") else 0) if text else 0


def read_tokenizer_files(path: str | os.PathLike) -> dict[str, bytes]:
    """The tokenizer files present in an HF folder (vocab.txt, tokenizer_config.json, ...); a Google-style folder
    with only vocab.txt gets HF's tokenizer_config.json and special_tokens_map.json generated, and a folder whose
    tokenizer transformers >= 5 saved (tokenizer.json, no vocab.txt) the vocab.txt that tokenizer.json holds
    (`vocab_from_tokenizer_json`)."""
    path = Path(path)
    files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
    lower: bool | None = None  # the casing tokenizer.json says, when the vocabulary comes from it
    if "vocab.txt" not in files and "tokenizer.json" in files:
        # transformers >= 5 saves a BERT tokenizer as tokenizer.json alone (no vocab.txt); bertrain tokenizes from
        # vocab.txt + do_lower_case, which is the same tokenizer when tokenizer.json is BERT's pipeline.
        vocab, lower, why_not = vocab_from_tokenizer_json(files["tokenizer.json"],
                                                          files.get("tokenizer_config.json"))
        if vocab is None:
            log.warning("%s: no vocab.txt, and its tokenizer.json %s: bertrain cannot tokenize for this model",
                        path, why_not)
        else:
            log.info("%s: no vocab.txt; writing the one its tokenizer.json holds (%d tokens)", path,
                     vocab_size_of(vocab))
            files["vocab.txt"] = vocab
    if "vocab.txt" in files and "tokenizer_config.json" not in files:
        if lower is None:
            # Google's releases say "uncased"/"cased" in the folder name; uncased (lower-casing) is the common
            # default.
            lower = not ("cased" in path.name.lower() and "uncased" not in path.name.lower())
        log.info("%s: no tokenizer_config.json; writing one with do_lower_case=%s", path, lower)
        generated = _tokenizer_files(files["vocab.txt"], path / "vocab.txt", do_lower_case=lower)
        files = {**generated, **files}
    return files


def vocab_from_tokenizer_json(tokenizer_json: bytes,
                              tokenizer_config: bytes | None = None) -> tuple[bytes | None, bool | None, str]:
    """(vocab.txt, lower-cases, "") from an HF `tokenizers` tokenizer.json that is BERT's WordPiece tokenizer, the
    one bertrain rebuilds from vocab.txt and do_lower_case: BertNormalizer (cleaning text, splitting CJK characters,
    accents stripped exactly when lower-casing), BertPreTokenizer, WordPiece with "##" and [UNK], every added token
    inside the vocabulary. Else (None, None, why not, as a phrase): a vocab.txt of another tokenizer would tokenize
    otherwise than it."""
    try:
        data = json.loads(tokenizer_json)
        model, norm = data["model"], data.get("normalizer") or {}
        pre = (data.get("pre_tokenizer") or {}).get("type")
        config = json.loads(tokenizer_config) if tokenizer_config else {}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return None, None, f"cannot be read ({type(e).__name__}: {e})"
    kind = model.get("type") if isinstance(model, dict) else type(model).__name__
    if kind != "WordPiece" or not isinstance(model.get("vocab"), dict):
        return None, None, f"holds a {kind} model, not BERT's WordPiece"
    if model.get("continuing_subword_prefix", "##") != "##" or model.get("unk_token") != "[UNK]":
        return None, None, "has another subword prefix or unknown token than BERT's (## and [UNK])"
    if norm.get("type") != "BertNormalizer" or pre != "BertPreTokenizer":
        return None, None, (f"normalizes with {norm.get('type')} and pre-tokenizes with {pre}, not with BERT's "
                            "BertNormalizer and BertPreTokenizer")
    lower = norm.get("lowercase", True)
    if not norm.get("clean_text", True) or not norm.get("handle_chinese_chars", True) \
            or norm.get("strip_accents") not in (None, lower):
        return None, None, ("sets its BertNormalizer otherwise than BERT does (clean_text and handle_chinese_chars "
                            f"on, accents stripped exactly when lower-casing): {json.dumps(norm)}")
    if isinstance(config, dict) and "do_lower_case" in config and config["do_lower_case"] != lower:
        return None, None, (f"lower-cases = {lower} but tokenizer_config.json says do_lower_case = "
                            f"{config['do_lower_case']}")
    vocab = model["vocab"]
    by_id = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in by_id] != list(range(len(by_id))):
        return None, None, "numbers its WordPiece vocabulary with gaps or repeated ids"
    outside = [t.get("content") for t in data.get("added_tokens") or []
               if isinstance(t, dict) and vocab.get(t.get("content")) != t.get("id")]
    if outside:
        return None, None, f"adds tokens outside its WordPiece vocabulary ({', '.join(map(str, outside[:5]))})"
    from bertrain.data.tokenizer import vocab_lines

    if "" in by_id or vocab_lines("\n".join(by_id)) != by_id:  # a vocab.txt that `read_vocab` reads back as is
        return None, None, "has an empty token or one holding a line break, which a vocab.txt cannot hold"
    return ("\n".join(by_id) + "\n").encode("utf-8"), bool(lower), ""


def load_pretrained(cls: type[BertPreTrainedModel], path: str | os.PathLike, **kwargs: Any) -> BertPreTrainedModel:
    """`cls.from_pretrained(path, **kwargs)`: load an HF-format folder or a bertrain checkpoint folder; missing
    heads are initialised and reported. Keyword arguments override config fields (e.g. hidden_dropout_prob=0.0);
    `num_labels` for classification. `path` may be a Hub model id in the local HF cache (`resolve_model_dir`)."""
    path = resolve_model_dir(path)
    config_file = find_config_file(path)
    raw_config = read_config_json(config_file)
    config = _config_of(config_file, raw_config)  # validates, naming the file
    num_labels = kwargs.pop("num_labels", None)
    if num_labels is not None and cls is not BertForSequenceClassification:
        raise TypeError(f"{cls.__name__}.from_pretrained: num_labels is only for BertForSequenceClassification")
    fields = set(config.__dataclass_fields__)
    unknown = [k for k in kwargs if k not in fields]
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained: unknown argument(s) {', '.join(unknown)}; "
                        f"config fields can be overridden: {', '.join(sorted(fields))}")
    if kwargs:
        try:
            config = BertConfig(**{**config.__dict__, **kwargs})
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None

    tokenizer_files = read_tokenizer_files(path)
    vocab_lines = vocab_size_of(tokenizer_files["vocab.txt"]) if "vocab.txt" in tokenizer_files else None
    # NVIDIA's run_squad.py / run_glue.py save the config with the vocabulary padded: whether that is what a config
    # saying exactly vocab.txt's padding means is known once the weights say whose they are (checked again below).
    padded_by_nvidia = nvidia_checkpoint.vocab_size(config.vocab_size, vocab_lines) != config.vocab_size
    if vocab_lines is not None and vocab_lines != config.vocab_size and not padded_by_nvidia:
        raise _vocab_mismatch(path, config_file, vocab_lines, config.vocab_size)

    weights = weights_files(path)
    source_file = ", ".join(str(f) for f in weights)
    if _is_tf_checkpoint(weights[0]) and "hidden_act" not in kwargs:
        config = google_activation(config, config_file)
    raw, nvidia_saved = _read_weights(weights)
    if nvidia_saved is not None:
        config = nvidia_config(config, config_file, source_file, vocab_lines, nvidia_saved, "hidden_act" in kwargs)
    if vocab_lines is not None and vocab_lines != config.vocab_size:
        raise _vocab_mismatch(path, config_file, vocab_lines, config.vocab_size)
    with_prefix = cls is not BertModel
    source = _normalize_keys(raw, with_prefix)

    # The MLM decoder is tied to the word embeddings; old checkpoints store copies of both it and its bias.
    mlm = "cls.predictions."
    if mlm + "decoder.bias" in source and mlm + "bias" not in source:
        source[mlm + "bias"] = source[mlm + "decoder.bias"]
    decoder = source.get(mlm + "decoder.weight")
    for key in _TIED_DECODER:
        source.pop(key, None)

    if cls is BertForSequenceClassification:
        found = source["classifier.weight"].shape[0] if "classifier.weight" in source else None
        from_config = len(raw_config["id2label"]) if isinstance(raw_config.get("id2label"), dict) else None
        if num_labels is None:
            num_labels = found or raw_config.get("num_labels") or from_config or 2
        elif found is not None and found != num_labels:
            log.warning("%s: the classification head has %d labels, not num_labels=%d: re-initialising it",
                        source_file, found, num_labels)
            source.pop("classifier.weight"), source.pop("classifier.bias", None)
        if "classifier.weight" in source:  # the head is used as trained: it must mean what bertrain computes
            _check_problem_type(raw_config.get("problem_type"), num_labels, config_file)
        model = cls(config, num_labels=num_labels)
        id2label = raw_config.get("id2label")
        if isinstance(id2label, dict) and len(id2label) == num_labels:
            model.id2label = {int(k): str(v) for k, v in id2label.items()}
    else:
        model = cls(config)

    template = to_hf_state_dict(model)  # every HF key this class has, with its shape
    _check_tied_decoder(raw_config, config_file, source_file, decoder, source, template)
    for key, t in source.items():
        if key in template and tuple(t.shape) != tuple(template[key].shape):
            raise ValueError(f"{source_file}: {key} has shape {tuple(t.shape)} but {config_file} implies "
                             f"{tuple(template[key].shape)}; the weights and config.json do not belong together")
    missing = [k for k in template if k not in source]
    unexpected = [k for k in source if k not in template]
    initialised = _head_groups(missing)
    not_heads = [k for k in missing if not any(k.split("bert.", 1)[-1].startswith(p) for p in HEADS.values())]
    if not_heads:
        raise ValueError(f"{source_file}: missing {len(not_heads)} encoder weight(s) for {cls.__name__}: "
                         f"{_short(not_heads)}")
    if "num_hidden_layers" not in kwargs:  # given, fewer layers are the caller's choice (the first ones are kept)
        _check_no_extra_layers(unexpected, config.num_hidden_layers, config_file, source_file)

    hf = {k: source[k].to(template[k].dtype) for k in template if k in source}
    ours = from_hf_state_dict(hf, config)
    result = model.load_state_dict(ours, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    model.tokenizer_files = tokenizer_files

    if initialised:
        log.warning("%s: no weights for the %s in %s: initialised randomly (train before use)", cls.__name__,
                    ", ".join(f"{name} ({HEADS[name]}*)" for name in initialised), path)
    other_heads = [k for k in unexpected if k.split("bert.", 1)[-1].startswith(tuple(HEADS.values()))]
    strange = [k for k in unexpected if k not in other_heads]
    if other_heads:
        log.info("%s: not using %d head weight(s) of %s: %s", cls.__name__, len(other_heads), path,
                 _short(other_heads))
    if strange:
        log.warning("%s: ignoring %d unexpected weight(s) in %s: %s", cls.__name__, len(strange), source_file,
                    _short(strange))
    model.loading_info = {"initialized": initialised, "missing_keys": missing, "unexpected_keys": unexpected}
    return model


def google_activation(config: BertConfig, config_file: Path) -> BertConfig:
    """The config of a model whose weights are a TensorFlow checkpoint of Google's (or NVIDIA's) BERT code, which
    computes "gelu" as the tanh approximation, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) (modeling.py's `gelu`),
    where HF and bertrain read "gelu" as the exact erf GELU: so "gelu" becomes "gelu_new", the name transformers
    gives that very function, and the model computes what it was trained with (`bertrain convert` writes it into
    config.json, for transformers too). The one place this is decided; HF folders are taken at their word."""
    if config.hidden_act != "gelu":
        return config
    log.info("%s says hidden_act \"gelu\", which Google's TensorFlow BERT computes with the tanh approximation: "
             "using \"gelu_new\" (that approximation) for this TensorFlow checkpoint", config_file)
    return dataclasses.replace(config, hidden_act="gelu_new")


def computed_config(path: Path, config: BertConfig, config_file: Path) -> BertConfig:
    """The config a model folder's weights are computed with, without building the model: `config` (read from
    `config_file`) with what `load_pretrained` changes for Google's TensorFlow checkpoints (`google_activation`) and
    NVIDIA's `*.pt` checkpoints (`nvidia_config`, from the file's entry names: memory-mapped, no tensor read). A
    folder without weights, or with HF's, is taken at its word (for `bertrain info`)."""
    try:
        weights = weights_files(path)
    except ValueError:
        return config
    if _is_tf_checkpoint(weights[0]):
        return google_activation(config, config_file)
    if weights[0].suffix == nvidia_checkpoint.SUFFIX:
        obj = nvidia_checkpoint.load_file(weights[0])
        saved = nvidia_checkpoint.model_state(obj, weights[0])[1]
        vocab = path / "vocab.txt"
        lines = vocab_size_of(vocab.read_bytes()) if vocab.is_file() else None
        return nvidia_config(config, config_file, str(weights[0]), lines, saved, keep_act=False)
    return config


def nvidia_config(config: BertConfig, config_file: Path, source_file: str, vocab_lines: int | None,
                  saved: tuple[str, ...], keep_act: bool) -> BertConfig:
    """The config of a model whose weights are a checkpoint of NVIDIA's PyTorch BERT scripts: the vocabulary its
    weights were cut to (`nvidia_checkpoint.vocab_size`: a padded vocab_size that run_squad.py / run_glue.py saved
    is vocab.txt's), and "gelu" as the NVIDIA code that wrote the file computed it (`nvidia_checkpoint.hidden_act`:
    the exact erf GELU until 2020, the tanh approximation, "gelu_new", since 2022), unless `keep_act` (the caller
    gave hidden_act). The one place this is decided, as `google_activation` for Google's checkpoints."""
    changes: dict[str, Any] = {"vocab_size": nvidia_checkpoint.vocab_size(config.vocab_size, vocab_lines)}
    if changes["vocab_size"] != config.vocab_size:
        log.info("%s says vocab_size = %d, the padded size NVIDIA's fine-tuning scripts save: using vocab.txt's %d",
                 config_file, config.vocab_size, changes["vocab_size"])
    if not keep_act:
        changes["hidden_act"], why = nvidia_checkpoint.hidden_act(config.hidden_act, saved)
        if why:
            log.info("%s: %s", source_file, why)
    return dataclasses.replace(config, **changes)


def _vocab_mismatch(path: Path, config_file: Path, tokens: int, vocab_size: int) -> ValueError:
    return ValueError(f"{path / 'vocab.txt'} has {tokens} tokens but {config_file} says vocab_size = {vocab_size}; "
                      "the vocabulary and the model do not belong together")


def _check_tied_decoder(raw_config: dict[str, Any], config_file: Path, source_file: str,
                        decoder: torch.Tensor | None, source: Mapping[str, torch.Tensor],
                        template: Mapping[str, torch.Tensor]) -> None:
    """Refuse an MLM head whose decoder is not the word embeddings (`tie_word_embeddings: false` in config.json,
    with its own `cls.predictions.decoder.weight`): bertrain's decoder *is* the word embedding matrix, so dropping
    the stored one, as for the tied copies old checkpoints carry, would predict other tokens than the model does
    in transformers. Classes without the MLM head do not use the decoder and load such a folder as it is."""
    if raw_config.get("tie_word_embeddings", True) is not False or decoder is None:
        return
    embeddings_key = next((k for k in template if k.endswith("embeddings.word_embeddings.weight")), None)
    if not any(k.startswith("cls.predictions.") for k in template) or embeddings_key not in source:
        return
    embeddings = source[embeddings_key]
    if decoder.shape == embeddings.shape and torch.equal(decoder.to(embeddings.dtype), embeddings):
        return  # untied in name only: the numbers are the tied model's
    raise ValueError(f"{config_file} says tie_word_embeddings = false and {source_file} holds an MLM decoder "
                     "(cls.predictions.decoder.weight) other than the word embeddings; bertrain's MLM head always "
                     "predicts with the word embeddings (as BERT does), so it cannot hold this model's MLM head. "
                     "Its encoder loads for fine-tuning (`bertrain finetune ... --init` this folder) or as a "
                     "BertModel")


def _check_no_extra_layers(unexpected: list[str], layers: int, config_file: Path, source_file: str) -> None:
    """Refuse weights of encoder layers beyond the config's num_hidden_layers: a config.json of a shallower model
    beside the weights (a copied bert_config.json of another size) would load the first layers only, a different
    network, with only a warning about the keys left over."""
    extra = sorted({int(m.group(1)) for k in unexpected
                    if (m := re.match(r"(?:bert\.)?encoder\.layer\.(\d+)\.", k)) and int(m.group(1)) >= layers})
    if extra:
        raise ValueError(f"{source_file} holds {max(extra) + 1} encoder layers (weights of layer(s) "
                         f"{', '.join(map(str, extra))}) but {config_file} says num_hidden_layers = {layers}; the "
                         "weights and config.json do not belong together (to keep only the first layers on purpose, "
                         f"pass num_hidden_layers={layers} to from_pretrained)")


def _check_problem_type(problem_type: Any, num_labels: int, config_file: Path) -> None:
    """Refuse a trained classification head of a kind bertrain does not compute: its sequence classifier scores
    one label of several (softmax, cross-entropy) or, with one label, a regression value. transformers' other
    `problem_type`s (multi_label_classification: a sigmoid per label; regression with several outputs) would load
    without error, and predict, export (config.json without the problem_type) and fine-tuning would silently
    treat the head as single-label."""
    if problem_type in (None, "single_label_classification") or (problem_type == "regression" and num_labels == 1):
        return
    raise ValueError(f"{config_file}: problem_type = {problem_type!r} with {num_labels} labels: bertrain's sequence "
                     "classifiers score one label of several (softmax) or one regression value, so this model's "
                     "classification head would give other scores than in transformers. To fine-tune from its "
                     "encoder, `bertrain convert` it first (the classification head is left out)")


def _head_groups(keys: list[str]) -> list[str]:
    return [name for name, prefix in HEADS.items() if any(k.split("bert.", 1)[-1].startswith(prefix) for k in keys)]


def _short(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


def model_class_for(path: str | os.PathLike) -> type[BertPreTrainedModel]:
    """The bertrain class for a folder (or a Hub model id in the local HF cache): the one named in config.json's
    architectures, else by the heads present."""
    path = resolve_model_dir(path)
    raw = json.loads(find_config_file(path).read_text(encoding="utf-8"))
    for name in raw.get("architectures") or []:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    keys = {k.split("bert.", 1)[-1] for k in load_hf_state_dict(path)}
    if any(k.startswith("qa_outputs.") for k in keys):
        return BertForQuestionAnswering
    if any(k.startswith("classifier.") for k in keys):
        return BertForSequenceClassification
    if any(k.startswith("cls.") for k in keys):
        return BertForPreTraining
    return BertModel


# ----------------------------------------------------------------------------------------------- writing

def tokenizer_files_from_vocab(vocab_file: str | os.PathLike, do_lower_case: bool = True,
                               model_max_length: int = 512) -> dict[str, bytes]:
    """vocab.txt, tokenizer_config.json and special_tokens_map.json for HF's BertTokenizer, from a WordPiece
    vocab.txt that holds BERT's special tokens."""
    vocab_file = Path(vocab_file)
    try:
        vocab = vocab_file.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{vocab_file}: vocabulary file not found") from None
    return _tokenizer_files(vocab, vocab_file, do_lower_case, model_max_length)


def _tokenizer_files(vocab: bytes, vocab_file: Path, do_lower_case: bool = True,
                     model_max_length: int = 512) -> dict[str, bytes]:
    """`tokenizer_files_from_vocab` of the bytes of a vocab.txt (`vocab_file` names it in errors)."""
    tokens = set(vocab.decode("utf-8").split("\n"))
    absent = [t for t in SPECIAL_TOKENS.values() if t not in tokens]
    if absent:
        raise ValueError(f"{vocab_file}: BERT's special token(s) {', '.join(absent)} are not in the vocabulary")
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case, "do_basic_tokenize": True,
              "tokenize_chinese_chars": True, "strip_accents": None, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": True, **SPECIAL_TOKENS}
    return {"vocab.txt": vocab,
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
            "special_tokens_map.json": (json.dumps(SPECIAL_TOKENS, indent=2) + "\n").encode()}


def fit_model_max_length(tokenizer_config: bytes, max_positions: int) -> bytes:
    """tokenizer_config.json whose `model_max_length` is at most the model's position count: HF tokenizers truncate
    to it, and a longer input would fail in the position embeddings. Other files' bytes are kept as they are."""
    config = json.loads(tokenizer_config)
    length = config.get("model_max_length")
    if isinstance(length, (int, float)) and length <= max_positions:
        return tokenizer_config
    return (json.dumps({**config, "model_max_length": max_positions}, indent=2) + "\n").encode()


def hf_config_dict(model: BertPreTrainedModel) -> dict[str, Any]:
    """config.json for `model`: the BERT fields, its class as the architecture, labels for classification."""
    d = config_to_hf_dict(model.config, [type(model).__name__])
    if isinstance(model, BertForSequenceClassification):
        id2label = getattr(model, "id2label", None) or {i: f"LABEL_{i}" for i in range(model.num_labels)}
        d["id2label"] = {str(i): label for i, label in sorted(id2label.items())}
        d["label2id"] = {label: i for i, label in sorted(id2label.items())}
        if model.num_labels == 1:
            d["problem_type"] = "regression"
    return d


def save_pretrained(model: BertPreTrainedModel, path: str | os.PathLike) -> None:
    """Write an HF folder into `path` (created if needed; other files in it are left alone, so a trainer can add
    its own). Each file is written atomically; config.json last."""
    path = Path(path)
    files = dict(getattr(model, "tokenizer_files", {}) or {})
    if "vocab.txt" in files and vocab_size_of(files["vocab.txt"]) != model.config.vocab_size:
        raise ValueError(f"{path}: the model's vocab.txt has {vocab_size_of(files['vocab.txt'])} tokens but "
                         f"vocab_size = {model.config.vocab_size}; refusing to write a folder that cannot load")
    if not files:
        log.warning("%s: the model carries no tokenizer files; the folder will have no vocab.txt "
                    "(set model.tokenizer_files = tokenizer_files_from_vocab(...))", path)
    # Own, contiguous CPU copies: safetensors refuses views that share storage.
    tensors = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in to_hf_state_dict(model).items()}
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path / SAFETENSORS, save_safetensors(tensors, metadata={"format": "pt"}))
    save_config_and_tokenizer(model, path)


def save_config_and_tokenizer(model: BertPreTrainedModel, path: Path, class_name: str | None = None) -> None:
    """config.json (last) and the tokenizer files of `model` into `path`: an HF folder's files besides the weights
    (a sharded checkpoint has them too, its weights being DCP shards). `class_name`: the architecture, when
    `type(model)` is a wrapper (FSDP2's subclass of the model's class)."""
    files = dict(getattr(model, "tokenizer_files", {}) or {})
    if "tokenizer_config.json" in files:
        files["tokenizer_config.json"] = fit_model_max_length(files["tokenizer_config.json"],
                                                              model.config.max_position_embeddings)
    for name, data in files.items():
        atomic_write_bytes(path / name, data)
    config = hf_config_dict(model)
    if class_name:
        config["architectures"] = [class_name]
    atomic_write_json(path / "config.json", config)


# ----------------------------------------------------------------------------------------------- the model API

# The model classes load and save through this module; bert.py declares these methods for readers and type
# checkers but cannot define them without importing this module, which would make a cycle.
BertPreTrainedModel.from_pretrained = classmethod(load_pretrained)  # type: ignore[method-assign, assignment]
BertPreTrainedModel.save_pretrained = save_pretrained  # type: ignore[method-assign]
