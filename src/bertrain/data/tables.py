"""Tables: Parquet files and HF `datasets` folders (Arrow) read as columns, streamed in record batches.

The corpus readers (`bertrain.data.readers`: one text column), GLUE (`bertrain.tasks.glue`: the Hub's columns)
and SQuAD (`bertrain.tasks.squad`) read these through here. Two layouts of files:

* Parquet (`.parquet`): what the Hugging Face Hub serves (`<config>/<split>-00000-of-00003.parquet`), LDDL writes,
  and most data tools export. Read one row group at a time, only the columns asked for.
* `datasets` folders (`Dataset.save_to_disk`): `state.json` names the Arrow files (`data-00000-of-00002.arrow`,
  Arrow IPC streams) in their order; a `DatasetDict` folder holds one such folder per split and lists the splits
  in `dataset_dict.json`. A single `.arrow` file (a stream, or the IPC file format) is read the same way.

pyarrow (the `data` extra: `pip install 'bertrain[data]'`) is imported only when such a file is read, so the core
install stays light. A missing or mistyped column is one `UserError` naming the file, the column and what was
expected (`Table.column`); a file pyarrow cannot read is one naming the file.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from bertrain.utils.errors import UserError

DATASET_STATE = "state.json"  # a `Dataset.save_to_disk` folder: its Arrow files in order
DATASET_DICT = "dataset_dict.json"  # a `DatasetDict.save_to_disk` folder: its splits, one sub-folder each
TABLE_SUFFIXES = (".parquet", ".arrow")

# Rows per record batch when reading: bounded memory whatever the file (a batch of long documents is a few MB).
BATCH_ROWS = 256
# A Parquet row group (all columns, decoded) up to this size is read whole; a larger one is streamed in batches.
_LARGE_ROW_GROUP = 64 << 20


def require_pyarrow(path: str | os.PathLike) -> Any:
    """The pyarrow module, or a `UserError` saying how to install it (named after the file that needs it).

    Before the first import it asks Arrow for the system allocator unless the user chose one
    (ARROW_DEFAULT_MEMORY_POOL): Arrow's default, mimalloc, kept freed record batches and a reading process grew by
    ~45 MB over the first few hundred MB of a corpus; with the system allocator it stays within ~15 MB from 4 MB
    to 4 GB at the same speed (BENCHMARKS.md, data preparation)."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    try:
        import pyarrow
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow (Parquet and `datasets` Arrow files): "
                        "pip install 'bertrain[data]'") from None
    return pyarrow


# ----------------------------------------------------------------------------------------------- datasets folders

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} (of a `datasets` folder): {e}") from None


def dataset_files(folder: str | os.PathLike) -> list[Path] | None:
    """The Arrow files of a `Dataset.save_to_disk` folder in their order (from its state.json), or None when
    `folder` is not one. A listed file that is missing is a `UserError`."""
    folder = Path(folder)
    state_path = folder / DATASET_STATE
    if not state_path.is_file():
        return None
    state = _read_json(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("filename"), str)
                                                for e in entries):
        return None  # some other tool's state.json: not a datasets folder
    files = [folder / e["filename"] for e in entries]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{state_path} lists {', '.join(missing)}, which do not exist: the `datasets` folder is "
                        "incomplete (save it again with save_to_disk)")
    return files


def dataset_splits(folder: str | os.PathLike) -> list[str] | None:
    """The splits of a `DatasetDict.save_to_disk` folder in their order (its dataset_dict.json), or None."""
    path = Path(folder) / DATASET_DICT
    if not path.is_file():
        return None
    data = _read_json(path)
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise UserError(f"{path}: expected {{\"splits\": [names]}} (a `DatasetDict.save_to_disk` folder)")
    return splits


def split_files(folder: str | os.PathLike, split: str) -> list[Path]:
    """The Arrow files of split `split` of a `DatasetDict` folder; a `UserError` naming the splits it has."""
    folder = Path(folder)
    splits = dataset_splits(folder) or []
    files = dataset_files(folder / split) if split in splits else None
    if files is None:
        raise UserError(f"{folder} (a `datasets` DatasetDict folder) has no split {split!r}; its splits: "
                        f"{', '.join(splits) or 'none'}")
    return files


def hub_split_files(folder: str | os.PathLike, split: str) -> list[Path]:
    """The Parquet files of split `split` in a Hub-layout folder: `split-*.parquet` (`train-00000-of-00002.parquet`)
    or `split.parquet`, sorted. ("validation" does not take "validation_matched-*": the name ends at the dash.)"""
    folder = Path(folder)
    return sorted(p for p in folder.glob("*.parquet")
                  if p.is_file() and (p.name == f"{split}.parquet" or p.name.startswith(f"{split}-")))


def hub_splits(folder: str | os.PathLike) -> list[str]:
    """The split names of the Parquet files in a Hub-layout folder (the part of each name before its first dash)."""
    return sorted({p.name.split("-", 1)[0].removesuffix(".parquet") for p in Path(folder).glob("*.parquet")})


# ----------------------------------------------------------------------------------------------- one file

def _type_name(tp: Any) -> str:
    return str(tp).replace("element: ", "").replace("item: ", "")


class Table:
    """One Parquet or Arrow file, opened for reading columns batch by batch.

    `with Table(path) as t: t.column("text", "string"); for batch, pos in t.batches(["text"]): ...` — `pos` is how
    far into the file on disk the batches read so far reach (the reading progress)."""

    def __init__(self, path: str | os.PathLike, fmt: str | None = None):
        self.path = str(path)
        self.fmt = fmt or ("parquet" if self.path.lower().endswith(".parquet") else "arrow")
        pa = require_pyarrow(self.path)
        self._pa = pa
        self.size = os.path.getsize(self.path)
        self._file = None
        try:
            if self.fmt == "parquet":
                import pyarrow.parquet as pq

                self._pq_module = pq
                self._pq = pq.ParquetFile(self.path)
                self.schema = self._pq.schema_arrow
                self.num_rows: int | None = self._pq.metadata.num_rows
            else:
                import pyarrow.ipc

                self._file = pa.OSFile(self.path)  # plain reads, not a memory map: RSS stays a batch, not the file
                try:  # `datasets` writes IPC streams; the IPC file format (Feather v2) is read too
                    self._ipc = pyarrow.ipc.open_stream(self._file)
                    self._stream = True
                except pa.ArrowInvalid:
                    self._file.seek(0)
                    self._ipc = pyarrow.ipc.open_file(self._file)
                    self._stream = False
                self.schema = self._ipc.schema
                self.num_rows = None
        except (pa.ArrowException, OSError) as e:
            self.close()
            what = "Parquet" if self.fmt == "parquet" else "Arrow (IPC stream or file)"
            raise UserError(f"{self.path} is not a readable {what} file: {e}") from None

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def features(self) -> dict[str, Any]:
        """The `datasets` features stored in the file's schema (ClassLabel names...), or {} when there are none."""
        meta = self.schema.metadata or {}
        raw = meta.get(b"huggingface")
        if not raw:
            return {}
        try:
            feats = json.loads(raw).get("info", {}).get("features", {})
        except (ValueError, AttributeError):
            return {}
        return feats if isinstance(feats, dict) else {}

    def class_names(self, column: str) -> list[str] | None:
        """The ClassLabel names of `column` stored in the file, or None."""
        f = self.features().get(column)
        if isinstance(f, dict) and f.get("_type") == "ClassLabel" and isinstance(f.get("names"), list):
            return [str(n) for n in f["names"]]
        return None

    def has(self, column: str) -> bool:
        return column in self.schema.names

    def column(self, name: str, expected: str, hint: str = "") -> Any:
        """The type of column `name`, checked to be `expected`: "string", "integer", "number" (integer or floating
        point), "label" (integer or string), or "answers" (SQuAD: struct of lists text / answer_start, or a list of
        such structs). A missing column or another type is one `UserError` naming the file, the column and what was
        expected (and `hint`: what to do)."""
        pa = self._pa
        if name not in self.schema.names:
            raise UserError(f"{self.path} has no column {name!r} (expected {_EXPECTED[expected]}); its columns: "
                            f"{', '.join(self.schema.names) or 'none'}" + (f"; {hint}" if hint else ""))
        tp = self.schema.field(name).type
        if pa.types.is_dictionary(tp):
            tp = tp.value_type
        if not _is_type(pa, tp, expected):
            raise UserError(f"{self.path}: column {name!r} is {_type_name(tp)}, expected {_EXPECTED[expected]}"
                            + (f"; {hint}" if hint else ""))
        return tp

    def batches(self, columns: list[str], batch_rows: int = BATCH_ROWS) -> Iterator[tuple[Any, int]]:
        """(record batch of `columns`, position on disk reached) for each batch, in file order."""
        pa = self._pa
        try:
            if self.fmt == "parquet":
                rows, total = 0, max(self.num_rows or 0, 1)
                for batch in self._parquet_batches(columns, batch_rows):
                    rows += batch.num_rows
                    yield batch, int(self.size * min(rows / total, 1.0))
            else:
                ipc = self._ipc
                for batch in ipc if self._stream else (ipc.get_batch(i) for i in range(ipc.num_record_batches)):
                    batch = batch.select(columns)
                    for start in range(0, max(batch.num_rows, 1), batch_rows):
                        part = batch.slice(start, batch_rows)
                        if part.num_rows:
                            yield part, self._file.tell()
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{self.path}: cannot read the rows ({e}); the file is damaged or truncated") from None

    def _parquet_batches(self, columns: list[str], batch_rows: int) -> Iterator[Any]:
        """A row group's columns at a time, cut into batches. Why not `ParquetFile.iter_batches` over the file: on
        a 60 MB file of 2.9 MB row groups Arrow's memory pool peaked at 66 MB with it, 4.5 MB this way, at the same
        speed (BENCHMARKS.md, data preparation). A row group larger than `_LARGE_ROW_GROUP` is streamed through a
        buffered `iter_batches` of its own instead."""
        meta = self._pq.metadata
        for i in range(meta.num_row_groups):
            if meta.row_group(i).total_byte_size > _LARGE_ROW_GROUP:
                big = self._pq_module.ParquetFile(self.path, buffer_size=1 << 20)
                yield from big.iter_batches(batch_size=batch_rows, row_groups=[i], columns=columns,
                                            use_threads=False)
                continue
            yield from self._pq.read_row_group(i, columns=columns, use_threads=False).to_batches(max_chunksize=batch_rows)

    def read(self, columns: list[str]) -> dict[str, list]:
        """`columns` of every row as Python lists (small tables: GLUE, SQuAD)."""
        out: dict[str, list] = {c: [] for c in columns}
        for batch, _ in self.batches(columns, batch_rows=1 << 16):
            for c in columns:
                out[c].extend(batch.column(c).to_pylist())
        return out


_EXPECTED = {
    "string": "a string column",
    "integer": "an integer column",
    "number": "a numeric column (integer or floating point)",
    "label": "an integer (class id) or string column",
    "answers": "struct<text: list<string>, answer_start: list<int>> (the Hub's SQuAD layout) or "
               "list<struct<text: string, answer_start: int>>",
}


def _is_string(pa: Any, tp: Any) -> bool:
    return pa.types.is_string(tp) or pa.types.is_large_string(tp) or getattr(pa.types, "is_string_view",
                                                                             lambda _: False)(tp)


def _is_list(pa: Any, tp: Any) -> bool:
    return pa.types.is_list(tp) or pa.types.is_large_list(tp)


def _is_type(pa: Any, tp: Any, expected: str) -> bool:
    if expected == "string":
        return _is_string(pa, tp)
    if expected == "integer":
        return pa.types.is_integer(tp)
    if expected == "number":
        return pa.types.is_integer(tp) or pa.types.is_floating(tp)
    if expected == "label":
        return pa.types.is_integer(tp) or _is_string(pa, tp)
    if expected == "answers":
        def fields_ok(struct: Any, text_ok, start_ok) -> bool:
            names = {struct.field(i).name: struct.field(i).type for i in range(struct.num_fields)}
            return "text" in names and "answer_start" in names and text_ok(names["text"]) \
                and start_ok(names["answer_start"])
        if pa.types.is_struct(tp):  # the Hub's: a struct of two lists
            return fields_ok(tp, lambda t: _is_list(pa, t) and _is_string(pa, t.value_type),
                             lambda t: _is_list(pa, t) and pa.types.is_integer(t.value_type))
        if _is_list(pa, tp) and pa.types.is_struct(tp.value_type):  # a list of {text, answer_start}
            return fields_ok(tp.value_type, lambda t: _is_string(pa, t), pa.types.is_integer)
        return False
    raise ValueError(f"unknown expected type {expected!r}")


def text_bytes(batch_column: Any) -> int:
    """UTF-8 bytes of a string column's values (from its offsets: no copy for string and large_string)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_string(batch_column.type) or pa.types.is_large_string(batch_column.type)):
        # Dictionary-encoded strings (pandas categories, Spark, `datasets` ClassLabel-like text) and string_view
        # (polars' IPC files) are string columns too, but `binary_length` has no kernel for them: the values as
        # large_string (a dictionary's value counted once per row that uses it).
        batch_column = batch_column.cast(pa.large_string())
    n = pc.sum(pc.binary_length(batch_column)).as_py()
    return int(n or 0)
