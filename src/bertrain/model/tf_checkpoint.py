"""Google's TensorFlow BERT checkpoints, read without TensorFlow, and their variable names mapped to HF's.

Google's releases (uncased_L-12_H-768_A-12.zip and the other original BERTs, BioBERT, SciBERT, the 24 small BERTs)
and the outputs of its run_pretraining.py / run_classifier.py / run_squad.py (and of NVIDIA's TF BERT) are
TensorFlow checkpoints: `PREFIX.index` + `PREFIX.data-00000-of-00001` beside bert_config.json and vocab.txt.
TensorFlow is a ~600 MB dependency just to read such a file, and transformers >= 5 dropped its TF support, including
the convert_bert_original_tf_checkpoint_to_pytorch script that used to do it; so the format is read here by hand.
It is small and stable (TF's tensor bundle, "V2" checkpoints, tensorflow/core/util/tensor_bundle):

* `PREFIX.index` is a LevelDB-format SSTable (tensorflow/core/lib/io/table): a 48-byte footer (the metaindex and
  index BlockHandles, each two varint64 offset/size, padded to 40 bytes, then the magic 0xdb4775248b80fb57); the
  index block maps keys to the data blocks' handles; each block is prefix-compressed entries (shared, non-shared,
  value length as varint32, the key's new bytes, the value), then the uint32 restart offsets and their count, and
  after the block a 5-byte trailer (compression type, which a bundle leaves at 0 = none, and a masked CRC32C).
* The entry with the empty key is a BundleHeaderProto (num_shards, endianness); every other key is a tensor's name
  and its value a BundleEntryProto (dtype, shape, shard_id, offset, size, crc32c, slices). The two protos are
  decoded here by hand (varints and the four wire types), which is smaller than depending on protobuf.
* The tensor's bytes are raw, in the header's byte order, at offset/size in `PREFIX.data-<shard>-of-<num_shards>`.

What is checked: the footer's magic, that the data files exist and hold every tensor's bytes (a truncated download
is one clear error naming the file), that size = elements x item size, and the CRC32C of every block and tensor
when a CRC32C implementation is importable (`google_crc32c` or `crc32c`, not dependencies of bertrain; without one
that check is skipped, since a pure-Python CRC over a 1.3 GB BERT-Large would take minutes). What is refused with
a message: compressed tables (TF never writes them for bundles) and partitioned variables (saved as `slices`).
String and other non-numeric tensors are listed but not read (no BERT weight is one).

Tensors are read one at a time through `np.memmap` (the page cache, not a copy of the file in memory) and copied
once into torch, so loading a checkpoint needs the model's size in memory, not several times it.

`load_bert_state_dict` then maps Google's variable names to HF's BERT names (what transformers 4.x's
`load_tf_weights_in_bert` did): `kernel`s are [in, out] in TF and transposed to torch's [out, in]; LayerNorm
`gamma`/`beta` are `weight`/`bias`; the heads of run_pretraining.py (`cls/predictions`, `cls/seq_relationship`),
run_squad.py (`cls/squad` -> `qa_outputs`) and run_classifier.py (top-level `output_weights`/`output_bias` ->
`classifier`). Optimizer slots (`.../adam_m`, `.../adam_v`, `.../Momentum`, NVIDIA's LAMB slots: any variable
under a mapped one) and bookkeeping (`global_step`, loss scales) are skipped and reported at info level; an
unknown variable under `bert/` is an error, since a model with parts bertrain does not have would compute wrongly.
"""
from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
CHECKPOINT_STATE = "checkpoint"  # the text file tf.train.Saver keeps beside its checkpoints
TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48  # two BlockHandles padded to 40 bytes, then the 8-byte magic
BLOCK_TRAILER_SIZE = 5  # compression type (1 byte) + masked crc32c (4 bytes)
HEADER_KEY = b""

# tensorflow/core/framework/types.proto: enum -> (name, numpy dtype; None where not read as numbers)
DTYPES: dict[int, tuple[str, np.dtype | None]] = {
    1: ("float32", np.dtype("<f4")), 2: ("float64", np.dtype("<f8")), 3: ("int32", np.dtype("<i4")),
    4: ("uint8", np.dtype("u1")), 5: ("int16", np.dtype("<i2")), 6: ("int8", np.dtype("i1")),
    7: ("string", None), 8: ("complex64", None), 9: ("int64", np.dtype("<i8")), 10: ("bool", np.dtype("?")),
    14: ("bfloat16", np.dtype("<u2")),  # numpy has no bfloat16: read as 16-bit words, viewed as torch.bfloat16
    17: ("uint16", np.dtype("<u2")), 18: ("complex128", None), 19: ("float16", np.dtype("<f2")),
    21: ("variant", None), 22: ("uint32", np.dtype("<u4")), 23: ("uint64", np.dtype("<u8")),
}
BFLOAT16 = 14


def _fix(path: Path | str) -> str:
    return f"{path}: damaged or not a TensorFlow checkpoint index; download or copy the checkpoint again"


# ----------------------------------------------------------------------------------------------- wire formats

def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    """(value, next position) of the (unsigned, up to 64-bit) varint at `pos`."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError(f"{_fix(where)} (a truncated or overlong varint)")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _int64(value: int) -> int:
    """A varint's two's-complement int64 (protobuf writes -1 as ten bytes)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def proto_fields(buf: bytes, where: str) -> dict[int, list[int | bytes]]:
    """A protobuf message's fields by number: varints as ints, fixed32/64 as ints, length-delimited as bytes."""
    fields: dict[int, list[int | bytes]] = {}
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos, where)
        number, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos, where)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos, where)
            value, pos = bytes(buf[pos:pos + n]), pos + n
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:  # groups (3, 4) are not in these protos
            raise ValueError(f"{_fix(where)} (protobuf wire type {wire}, which these messages do not use)")
        if pos > len(buf):
            raise ValueError(f"{_fix(where)} (a truncated protobuf field)")
        fields.setdefault(number, []).append(value)
    return fields


def _int(fields: dict[int, list[int | bytes]], number: int, where: str, default: int = 0) -> int:
    """The integer field `number` (protobuf: the last occurrence of a scalar field wins)."""
    value = fields.get(number, [default])[-1]
    if not isinstance(value, int):
        raise ValueError(f"{_fix(where)} (field {number} is not an integer)")
    return value


def _message(fields: dict[int, list[int | bytes]], number: int, where: str) -> bytes:
    """The embedded message (or bytes) field `number`; empty where absent."""
    value = fields.get(number, [b""])[-1]
    if not isinstance(value, bytes):
        raise ValueError(f"{_fix(where)} (field {number} is not a message)")
    return value


# ----------------------------------------------------------------------------------------------- the SSTable

def _block(data: bytes, offset: int, size: int, where: str, crc: Callable[[bytes], int] | None) -> bytes:
    """The contents of the block at `offset`/`size`, its trailer checked."""
    end = offset + size + BLOCK_TRAILER_SIZE
    if end > len(data) - FOOTER_SIZE or size < 4:
        raise ValueError(f"{_fix(where)} (a block lies outside the file)")
    contents, kind = data[offset:offset + size], data[offset + size]
    if kind != 0:  # TF's table: 1 = snappy; tensor bundles are always written uncompressed
        raise ValueError(f"{where}: a block is compressed (type {kind}), which TensorFlow never does for checkpoints "
                         "and bertrain does not read; is this a TensorFlow checkpoint index?")
    if crc is not None:
        stored = int.from_bytes(data[offset + size + 1:end], "little")
        if _mask(crc(contents + bytes([kind]))) != stored:
            raise ValueError(f"{_fix(where)} (a block's checksum does not match)")
    return contents


def _block_entries(block: bytes, where: str) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) entries of a block, in order (keys are prefix-compressed against the previous one)."""
    num_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise ValueError(f"{_fix(where)} (a block's restart array is larger than the block)")
    key, pos = b"", 0
    while pos < end:
        shared, pos = _varint(block, pos, where)
        non_shared, pos = _varint(block, pos, where)
        value_length, pos = _varint(block, pos, where)
        if shared > len(key) or pos + non_shared + value_length > end:
            raise ValueError(f"{_fix(where)} (a block entry runs past its block)")
        key = key[:shared] + block[pos:pos + non_shared]
        pos += non_shared
        yield key, block[pos:pos + value_length]
        pos += value_length


def _handle(buf: bytes, pos: int, where: str) -> tuple[int, int, int]:
    """(offset, size, next position) of the BlockHandle at `pos`."""
    offset, pos = _varint(buf, pos, where)
    size, pos = _varint(buf, pos, where)
    return offset, size, pos


def read_table(path: Path, crc: Callable[[bytes], int] | None) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of the SSTable file `path`, in key order."""
    data = path.read_bytes()
    if len(data) < FOOTER_SIZE or int.from_bytes(data[-8:], "little") != TABLE_MAGIC:
        raise ValueError(f"{_fix(path)} (its last 8 bytes are not the table magic: the file is truncated or "
                         "overwritten)")
    footer = data[-FOOTER_SIZE:]
    _, _, pos = _handle(footer, 0, str(path))  # the metaindex: empty in a bundle (no filter blocks)
    index_offset, index_size, _ = _handle(footer, pos, str(path))
    for _, handle in _block_entries(_block(data, index_offset, index_size, str(path), crc), str(path)):
        offset, size, _ = _handle(handle, 0, str(path))
        yield from _block_entries(_block(data, offset, size, str(path), crc), str(path))


# ----------------------------------------------------------------------------------------------- CRC32C

def _mask(crc: int) -> int:
    """TF's (and LevelDB's) masked CRC32C, stored so that a CRC of data holding CRCs is not trivially related."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def crc32c_function() -> Callable[[bytes], int] | None:
    """A fast CRC32C of a bytes-like object, from `google_crc32c` or `crc32c` where installed; else None (the
    checksums are then not checked: a pure-Python CRC over a large checkpoint would take minutes)."""
    try:
        import google_crc32c
    except ImportError:
        pass
    else:
        if google_crc32c.implementation == "c":  # its pure-Python fallback is as slow as our own would be
            def value(data: bytes) -> int:
                try:
                    return google_crc32c.value(data)  # a read-only buffer (bytes, a read-only memmap) as it is
                except TypeError:
                    return google_crc32c.value(bytes(data))
            return value
    try:
        import crc32c
    except ImportError:
        return None
    return getattr(crc32c, "crc32c", None) or crc32c.crc32  # crc32c < 2.0 named it crc32


# ----------------------------------------------------------------------------------------------- the bundle

@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint, as its BundleEntryProto describes it."""
    name: str
    dtype: int  # TF's DataType enum
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int | None  # masked, as stored; None where absent

    @property
    def dtype_name(self) -> str:
        return DTYPES.get(self.dtype, (f"dtype {self.dtype}", None))[0]

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """How its bytes are read; None for strings, variants and types no BERT weight has (not read)."""
        return DTYPES.get(self.dtype, ("", None))[1]


def _shape(buf: bytes, where: str) -> tuple[int, ...]:
    """A TensorShapeProto: dim = 2 (each a message with size = 1), unknown_rank = 3."""
    fields = proto_fields(buf, where)
    if _int(fields, 3, where):
        raise ValueError(f"{_fix(where)} (a tensor of unknown rank)")
    shape = []
    for dim in fields.get(2, []):
        if not isinstance(dim, bytes):
            raise ValueError(f"{_fix(where)} (a dimension is not a message)")
        shape.append(_int64(_int(proto_fields(dim, where), 1, where)))
    if any(n < 0 for n in shape):
        raise ValueError(f"{_fix(where)} (a tensor of shape {shape})")
    return tuple(shape)


def _entry(name: str, value: bytes, where: str) -> TensorEntry:
    fields = proto_fields(value, f"{where} ({name})")
    if 7 in fields:
        raise ValueError(f"{where}: {name} is a partitioned variable (saved as slices), which bertrain does not "
                         "read; save it again unpartitioned in TensorFlow (restore it into the graph built without a "
                         "partitioner, then save)")
    where = f"{where} ({name})"
    return TensorEntry(name=name, dtype=_int(fields, 1, where), shape=_shape(_message(fields, 2, where), where),
                       shard_id=_int(fields, 3, where), offset=_int(fields, 4, where), size=_int(fields, 5, where),
                       crc32c=_int(fields, 6, where) if 6 in fields else None)


class TFCheckpoint:
    """The tensors of a TensorFlow (V2, "tensor bundle") checkpoint `PREFIX.index` + `PREFIX.data-*`, read without
    TensorFlow. Opening it reads the index and checks that the data files hold every tensor; `read` one at a time."""

    def __init__(self, prefix: str | os.PathLike, verify_crc: bool = True) -> None:
        prefix = Path(prefix)
        self.prefix = prefix.with_name(prefix.name[:-len(INDEX_SUFFIX)]) if prefix.name.endswith(INDEX_SUFFIX) \
            else prefix
        self.index = self.prefix.with_name(self.prefix.name + INDEX_SUFFIX)
        self._crc = crc32c_function() if verify_crc else None
        if self._crc is None and verify_crc:
            log.debug("%s: no google_crc32c or crc32c installed: checksums not verified", self.index)
        header: dict[int, list[int | bytes]] | None = None
        self.entries: dict[str, TensorEntry] = {}
        try:
            for key, value in read_table(self.index, self._crc):
                if key == HEADER_KEY:
                    header = proto_fields(value, str(self.index))
                    continue
                name = key.decode("utf-8", "replace")
                if "\ufffd" in name or not name.isprintable():  # TF's variable names are never so
                    raise ValueError(f"{_fix(self.index)} (a tensor name {key[:60]!r} is not a variable name)")
                self.entries[name] = _entry(name, value, str(self.index))
        except FileNotFoundError:
            raise ValueError(f"{self.index}: no such file; a TensorFlow checkpoint is PREFIX.index with "
                             "PREFIX.data-00000-of-00001 (give the folder that holds both)") from None
        if header is None:
            raise ValueError(f"{_fix(self.index)} (no bundle header: is this a TensorFlow 1.0-2.x checkpoint?)")
        self.num_shards = _int(header, 1, str(self.index), default=1)
        self.big_endian = _int(header, 2, str(self.index)) == 1
        if self.num_shards < 1:
            raise ValueError(f"{_fix(self.index)} (num_shards = {self.num_shards})")
        self._check_data_files()

    def data_file(self, shard_id: int) -> Path:
        return self.prefix.with_name(f"{self.prefix.name}.data-{shard_id:05d}-of-{self.num_shards:05d}")

    def _check_data_files(self) -> None:
        """Every data file exists and holds every tensor's bytes; every size fits its shape and dtype."""
        needed: dict[int, tuple[int, str]] = {}  # shard -> (bytes needed, the tensor ending last)
        for e in self.entries.values():
            if not 0 <= e.shard_id < self.num_shards:
                raise ValueError(f"{_fix(self.index)} ({e.name} names shard {e.shard_id} of {self.num_shards})")
            dtype = e.numpy_dtype
            if dtype is not None and e.size != math.prod(e.shape) * dtype.itemsize:
                raise ValueError(f"{_fix(self.index)} ({e.name}: {e.size} bytes for shape {list(e.shape)} of "
                                 f"{e.dtype_name})")
            end = e.offset + e.size
            if end > needed.get(e.shard_id, (0, ""))[0]:
                needed[e.shard_id] = (end, e.name)
        for shard in range(self.num_shards):
            f = self.data_file(shard)
            if not f.is_file():
                present = sorted(p.name for p in f.parent.glob(f"{self.prefix.name}.data-*"))
                raise ValueError(f"{f}: missing; the checkpoint {self.index.name} has {self.num_shards} data "
                                 f"file(s) ({', '.join(present) or 'none present'}): copy or download all of them "
                                 "into the folder")
            end, name = needed.get(shard, (0, ""))
            size = f.stat().st_size
            if size < end:
                raise ValueError(f"{f}: truncated ({size:,} bytes, but {name} ends at byte {end:,}): the download "
                                 "or copy is incomplete; download or copy it again")

    def variables(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype name) of every tensor, sorted by name (as `tf.train.list_variables`)."""
        return [(e.name, list(e.shape), e.dtype_name) for e in sorted(self.entries.values(), key=lambda e: e.name)]

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, as a torch tensor of its own memory (not a view of the file)."""
        e = self.entries[name]
        dtype = e.numpy_dtype
        if dtype is None:
            raise ValueError(f"{self.index}: {name} is a {e.dtype_name} tensor, which bertrain does not read")
        if self.big_endian:
            dtype = dtype.newbyteorder(">")
        f = self.data_file(e.shard_id)
        if e.size == 0:
            array = np.zeros(e.shape, dtype)
        else:
            mapped = np.memmap(f, dtype=np.uint8, mode="r", offset=e.offset, shape=(e.size,))
            if self._crc is not None and e.crc32c is not None and _mask(self._crc(mapped)) != e.crc32c:
                raise ValueError(f"{f}: the bytes of {name} do not match their checksum in {self.index.name}: the "
                                 "file is damaged; download or copy the checkpoint again")
            array = np.array(mapped.view(dtype).reshape(e.shape))  # one copy, out of the page cache
            del mapped
        if self.big_endian:
            array = array.astype(array.dtype.newbyteorder("="))
        if e.dtype == BFLOAT16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


# ----------------------------------------------------------------------------------------------- checkpoint files

def checkpoint_index(folder: str | os.PathLike) -> Path | None:
    """The `.index` file of the TensorFlow checkpoint in `folder`, or None where there is none. The one the
    `checkpoint` file names (`model_checkpoint_path`, as tf.train.Saver writes it), else the only `*.index`; several
    and no `checkpoint` file is an error listing them."""
    folder = Path(folder)
    state = folder / CHECKPOINT_STATE
    if state.is_file():
        named = _model_checkpoint_path(state)
        if named is not None:
            index = _local_index(folder, named)
            if index is None:
                raise ValueError(f"{state} names the checkpoint {named!r}, but {folder} has no "
                                 f"{Path(named).name}{INDEX_SUFFIX}; copy that checkpoint's files here, or edit "
                                 f"model_checkpoint_path in {state.name} to one of: {_candidates(folder)}")
            return index
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise ValueError(f"{folder}: holds {len(indexes)} TensorFlow checkpoints ({_candidates(folder)}) and no "
                         f"`{CHECKPOINT_STATE}` file saying which to use; write one with the line "
                         f'model_checkpoint_path: "{indexes[-1].name[:-len(INDEX_SUFFIX)]}" (the one you want), or '
                         "move the others out")
    return indexes[0] if indexes else None


def _candidates(folder: Path) -> str:
    return ", ".join(p.name[:-len(INDEX_SUFFIX)] for p in sorted(folder.glob(f"*{INDEX_SUFFIX}"))) or "none"


def _model_checkpoint_path(state: Path) -> str | None:
    """`model_checkpoint_path` of a `checkpoint` file (a CheckpointState text proto)."""
    try:
        text = state.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{state}: cannot be read ({e}); remove it to use the folder's only checkpoint") from None
    m = re.search(r'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"', text, re.MULTILINE)
    if m is None:
        return None
    # A C-escaped string: \" and \\, and non-ASCII bytes as octal escapes.
    raw = re.sub(rb"\\([0-7]{1,3}|.)", lambda e: bytes([int(e[1], 8) & 0xFF]) if e[1][:1].isdigit() else e[1],
                 m[1].encode("utf-8"))
    return raw.decode("utf-8", "replace") or None


def _local_index(folder: Path, named: str) -> Path | None:
    """The index of checkpoint prefix `named` in `folder`: by its file name (TF writes the prefix where training
    ran, often an absolute or gs:// path), else as a path relative to the folder."""
    local = [folder / PurePosixPath(named).name]  # the usual case: the folder was copied from where TF wrote it
    if not PurePosixPath(named).is_absolute() and "://" not in named:
        local.append(folder / named)
    for prefix in local:
        index = prefix.with_name(prefix.name + INDEX_SUFFIX)
        if index.is_file():
            return index
    return None


# ----------------------------------------------------------------------------------------------- Google's names

_LAYER = r"bert/encoder/layer_(\d+)"
_DENSE = [  # the scope of a tf.layers.dense -> its HF module: `kernel` (transposed) and `bias`
    (rf"{_LAYER}/attention/self/(query|key|value)", r"bert.encoder.layer.\1.attention.self.\2"),
    (rf"{_LAYER}/attention/output/dense", r"bert.encoder.layer.\1.attention.output.dense"),
    (rf"{_LAYER}/intermediate/dense", r"bert.encoder.layer.\1.intermediate.dense"),
    (rf"{_LAYER}/output/dense", r"bert.encoder.layer.\1.output.dense"),
    (r"bert/pooler/dense", "bert.pooler.dense"),
    (r"cls/predictions/transform/dense", "cls.predictions.transform.dense"),
]
_LAYER_NORM = [  # the scope of a layer_norm -> its HF module: `gamma` -> weight, `beta` -> bias
    (r"bert/embeddings/LayerNorm", "bert.embeddings.LayerNorm"),
    (rf"{_LAYER}/attention/output/LayerNorm", r"bert.encoder.layer.\1.attention.output.LayerNorm"),
    (rf"{_LAYER}/output/LayerNorm", r"bert.encoder.layer.\1.output.LayerNorm"),
    (r"cls/predictions/transform/LayerNorm", "cls.predictions.transform.LayerNorm"),
]
_AS_IS = [  # whole names; `output_weights` are [out, in] already (Google multiplies with transpose_b=True)
    (r"bert/embeddings/(word|position|token_type)_embeddings", r"bert.embeddings.\1_embeddings.weight"),
    (r"cls/predictions/output_bias", "cls.predictions.bias"),
    (r"cls/seq_relationship/output_weights", "cls.seq_relationship.weight"),
    (r"cls/seq_relationship/output_bias", "cls.seq_relationship.bias"),
    (r"cls/squad/output_weights", "qa_outputs.weight"),  # run_squad.py
    (r"cls/squad/output_bias", "qa_outputs.bias"),
    (r"output_weights", "classifier.weight"),  # run_classifier.py: [num_labels, hidden]
    (r"output_bias", "classifier.bias"),
]
_RULES: list[tuple[re.Pattern[str], str, bool]] = (
    [(re.compile(rf"{tf}/kernel"), rf"{hf}.weight", True) for tf, hf in _DENSE]
    + [(re.compile(rf"{tf}/bias"), rf"{hf}.bias", False) for tf, hf in _DENSE]
    + [(re.compile(rf"{tf}/gamma"), rf"{hf}.weight", False) for tf, hf in _LAYER_NORM]
    + [(re.compile(rf"{tf}/beta"), rf"{hf}.bias", False) for tf, hf in _LAYER_NORM]
    + [(re.compile(tf), hf, False) for tf, hf in _AS_IS])


def hf_key(tf_name: str) -> tuple[str, bool] | None:
    """(HF BERT key, transpose?) of a variable of Google's BERT, or None for any other variable."""
    for pattern, template, transpose in _RULES:
        m = pattern.fullmatch(tf_name)
        if m:
            return m.expand(template), transpose
    return None


def _slot_of(name: str, mapped: set[str]) -> bool:
    """Whether `name` lies under a model variable (`<var>/adam_m`, `<var>/Momentum`, `<var>/ExponentialMovingAverage`,
    NVIDIA's LAMB slots, ...): an optimizer's (or averager's) state for it, not a weight."""
    parts = name.split("/")
    return any("/".join(parts[:i]) in mapped for i in range(1, len(parts)))


def load_bert_state_dict(index: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of a Google-BERT TensorFlow checkpoint (`index`: its `.index` file) under HF BERT names, kernels
    transposed. Optimizer slots and bookkeeping are skipped (logged); unknown variables under `bert/` are refused."""
    ckpt = TFCheckpoint(index)
    keys = {name: hf_key(name) for name in ckpt.entries}
    mapped = {name for name, key in keys.items() if key is not None}
    unknown = [name for name, key in keys.items() if key is None and not _slot_of(name, mapped)]
    wrong = [name for name in unknown if name.startswith("bert/")]
    if wrong:
        raise ValueError(f"{ckpt.index}: variable(s) {', '.join(sorted(wrong)[:8])}"
                         f"{f', ... ({len(wrong) - 8} more)' if len(wrong) > 8 else ''} are not part of Google's BERT "
                         "(modeling.py), so bertrain would compute this model wrongly; it reads BERT checkpoints only "
                         "(not ALBERT, ELECTRA or other models saved under bert/)")
    if not any(name.startswith("bert/") for name in mapped):
        raise ValueError(f"{ckpt.index}: holds no variable of Google's BERT (bert/embeddings/..., "
                         f"bert/encoder/layer_N/...), but {', '.join(sorted(keys)[:5]) or 'nothing'}"
                         f"{' ...' if len(keys) > 5 else ''}; bertrain reads checkpoints of Google's BERT code "
                         "(modeling.py: its releases, run_pretraining/run_classifier/run_squad outputs, NVIDIA's TF "
                         "BERT), not TF 2 object-based (Keras / Model Garden) checkpoints")
    not_numbers = [n for n in mapped if ckpt.entries[n].numpy_dtype is None
                   or not ckpt.entries[n].dtype_name.startswith(("float", "bfloat"))]
    if not_numbers:
        n = sorted(not_numbers)[0]
        raise ValueError(f"{ckpt.index}: {n} is a {ckpt.entries[n].dtype_name} tensor, not floating point; "
                         "is this a BERT checkpoint?")
    skipped = len(keys) - len(mapped)
    if skipped:
        log.info("%s: skipped %d variable(s) that are not model weights (optimizer slots, global_step, ...): %s",
                 ckpt.index, skipped, ", ".join(sorted(set(keys) - mapped)[:8]) + (" ..." if skipped > 8 else ""))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(mapped):
        key, transpose = keys[name]  # type: ignore[misc]
        t = ckpt.read(name)
        if transpose:
            if t.dim() != 2:
                raise ValueError(f"{ckpt.index}: {name} has shape {list(t.shape)}; a dense kernel is 2-D")
            t = t.t().contiguous()  # TF's [in, out] -> torch's [out, in]
        out[key] = t
    return out
