"""Corpus formats of issue 24: Parquet files and folders (the Hub's layout), HF `datasets` folders (Arrow),
.jsonl.gz / .txt.gz / .zst, globs and a mix of formats in one run. Each is built here from the real corpora in
../shared/data (Tiny Shakespeare, the Wikipedia sample) with pyarrow / `datasets` and must prepare to the same
bytes as the text or XML it was built from; then the errors (a missing or mistyped column, a damaged file, a
missing extra), streaming and the `--text-column` option of `bertrain vocab` / `prepare`."""
from __future__ import annotations

import bz2
import gzip
import json
import sys
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow", reason="the data extra (pip install 'bertrain[data]') is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the data extra is not installed")
datasets = pytest.importorskip("datasets", reason="the data extra is not installed")
zstandard = pytest.importorskip("zstandard", reason="the data extra is not installed")

from bertrain.cli import main  # noqa: E402
from bertrain.data.prepare import prepare  # noqa: E402
from bertrain.data.progress import Progress  # noqa: E402
from bertrain.data.readers import CorpusConfig, SkipReport, iter_raw_documents, resolve_inputs  # noqa: E402
from bertrain.utils.errors import UserError  # noqa: E402
from conftest import shared_file  # noqa: E402
from helpers import TINY_VOCAB, digest, prepare_config  # noqa: E402


def raw_texts(inputs, **opts) -> list[str]:
    return [d.text for d in iter_raw_documents([str(p) for p in inputs], CorpusConfig(**opts), SkipReport())]


def quiet_datasets():
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def shakespeare():
    """(the text file, its documents as the text reader yields them)."""
    path = shared_file("text/tiny-shakespeare.txt")
    docs = raw_texts([path])
    assert len(docs) == 7222
    return path, docs


@pytest.fixture(scope="module")
def reference(shakespeare, tmp_path_factory):
    """The prepared store of the text file (static masking, several shards): what every format must give."""
    out = tmp_path_factory.mktemp("ref") / "prepared"
    prepare(prepare_config(out, inputs=[str(shakespeare[0])]))
    d = digest(out)
    assert sum(k.startswith("shards/") for k in d) > 3  # several shards, so shard boundaries are compared too
    return d


def _thirds(docs):
    n = len(docs)
    return docs[: n // 3], docs[n // 3: 2 * n // 3], docs[2 * n // 3:]


def _jsonl(docs, key="text") -> bytes:
    return "".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)).encode()


def _zst_frames(data: bytes, frames: int = 3) -> bytes:
    """zstd in several frames (what zstd on concatenated files and pzstd write)."""
    step = len(data) // frames + 1
    return b"".join(zstandard.ZstdCompressor(level=3).compress(data[i:i + step]) for i in range(0, len(data), step))


def _dataset(docs, column="text"):
    quiet_datasets()
    return datasets.Dataset.from_dict({"id": list(range(len(docs))), column: docs})


# Each builder writes the corpus in one format under `d` and returns (inputs, CorpusConfig options).
def build_parquet_file(path, docs, d):
    # small row groups: the reader streams many of them
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), d / "corpus.parquet", row_group_size=500)
    return [d / "corpus.parquet"], {}


def build_parquet_hub_folder(path, docs, d):
    """The Hub's layout: <config>/train-0000i-of-00003.parquet, plus the hidden .cache of a Hub download."""
    folder = d / "20231101.en"
    folder.mkdir()
    for i, part in enumerate(_thirds(docs)):
        pq.write_table(pa.table({"id": [str(j) for j in range(len(part))], "url": ["u"] * len(part),
                                 "title": ["t"] * len(part), "text": part}),
                       folder / f"train-{i:05d}-of-00003.parquet")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "train-00000-of-00003.parquet.metadata").write_text("not text\n")
    return [folder], {}


def build_parquet_glob(path, docs, d):
    for i, part in enumerate(_thirds(docs)):
        pq.write_table(pa.table({"text": part}), d / f"part-{i}.parquet")
    (d / "notes.txt").write_text("not matched by the glob\n")
    return [str(d / "part-*.parquet")], {}


def build_datasets_folder(path, docs, d):
    """`Dataset.save_to_disk` in several Arrow files, the text in a column named `content` (--text-column)."""
    _dataset(docs, "content").save_to_disk(str(d / "ds"), max_shard_size="300KB")
    assert len(list((d / "ds").glob("*.arrow"))) > 1
    return [d / "ds"], {"text_field": "content"}


def build_datasetdict_folder(path, docs, d):
    """`DatasetDict.save_to_disk`: its splits read in dataset_dict.json's order (train, then validation)."""
    a, b, c = _thirds(docs)
    datasets.DatasetDict({"train": _dataset(a + b), "validation": _dataset(c)}).save_to_disk(str(d / "dd"))
    return [d / "dd"], {}


def build_jsonl_gz(path, docs, d):
    (d / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl(docs)))
    return [d / "c.jsonl.gz"], {}


def build_txt_gz(path, docs, d):
    (d / "c.txt.gz").write_bytes(gzip.compress(path.read_bytes()))
    return [d / "c.txt.gz"], {}


def build_txt_zst(path, docs, d):
    (d / "c.txt.zst").write_bytes(_zst_frames(path.read_bytes()))
    return [d / "c.txt.zst"], {}


def build_jsonl_zst(path, docs, d):
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(docs)))
    return [d / "c.jsonl.zst"], {}


def build_txt_bz2(path, docs, d):
    (d / "c.txt.bz2").write_bytes(bz2.compress(path.read_bytes()))
    return [d / "c.txt.bz2"], {}


def build_mix(path, docs, d):
    """One run, four formats: the corpus in consecutive parts as .txt.zst, Parquet, a datasets folder, .jsonl.gz."""
    n = len(docs)
    parts = [docs[: n // 4], docs[n // 4: n // 2], docs[n // 2: 3 * n // 4], docs[3 * n // 4:]]
    (d / "p0.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(t + "\n" for t in parts[0]).encode()))
    pq.write_table(pa.table({"text": parts[1]}), d / "p1.parquet", row_group_size=300)
    _dataset(parts[2]).save_to_disk(str(d / "p2"))
    (d / "p3.jsonl.gz").write_bytes(gzip.compress(_jsonl(parts[3])))
    return [d / "p0.txt.zst", d / "p1.parquet", d / "p2", d / "p3.jsonl.gz"], {}


BUILDERS = {name.removeprefix("build_"): f for name, f in globals().items() if name.startswith("build_")}


@pytest.mark.parametrize("fmt", sorted(BUILDERS))
def test_every_format_prepares_the_same_bytes_as_the_text(fmt, shakespeare, reference, tmp_path):
    path, docs = shakespeare
    inputs, opts = BUILDERS[fmt](path, docs, tmp_path)
    assert raw_texts(inputs, **opts) == docs  # the same documents in the same order
    out = tmp_path / "prepared"
    prepare(prepare_config(out, inputs=[str(p) for p in inputs], corpus=CorpusConfig(**opts)))
    assert digest(out) == reference  # token shards, instances, held-out set, store.json: byte for byte


def test_wikipedia_as_parquet_prepares_like_the_xml_dump(tmp_path, capsys):
    """The Wikipedia sample as the Hub's wikimedia/wikipedia serves it (id, url, title, text: markup stripped,
    paragraphs separated by a blank line), two Parquet files: `bertrain prepare` on the folder gives the bytes it
    gives on the XML dump. (One shard: shards end at chunk ends, and chunks are measured in raw characters, which
    the XML's markup inflates.)"""
    from bertrain.data.wikitext import strip_wiki_markup

    xml = shared_file("wiki/enwiki-sample-pages-articles.xml.bz2")
    pages = list(iter_raw_documents([str(xml)], CorpusConfig(), SkipReport()))
    assert len(pages) == 98
    texts = ["\n\n".join(line for line in strip_wiki_markup(p.text).split("\n") if line.strip()) for p in pages]
    titles = [p.source.split("#", 1)[1] for p in pages]
    folder = tmp_path / "wikipedia" / "20231101.en"
    folder.mkdir(parents=True)
    for i, part in enumerate((slice(0, 50), slice(50, None))):
        pq.write_table(pa.table({"id": [str(j) for j in range(len(texts))][part], "url": titles[part],
                                 "title": titles[part], "text": texts[part]}),
                       folder / f"train-{i:05d}-of-00002.parquet", row_group_size=16)
    common = ["--vocab-file", TINY_VOCAB, "--workers", "1", "--dupe-factor", "2", "--shard-tokens", "100000000"]
    assert main(["prepare", "--input", str(xml), "--output", str(tmp_path / "xml"), *common]) == 0
    assert main(["prepare", "--input", str(folder.parent), "--output", str(tmp_path / "pq"), *common]) == 0
    capsys.readouterr()
    assert digest(tmp_path / "pq") == digest(tmp_path / "xml")
    stats = json.loads((tmp_path / "pq" / "stats.json").read_text())
    assert stats["skipped"]["files"] == 2 and stats["skipped"]["documents"] == 98


def test_vocab_and_prepare_take_a_text_column(shakespeare, tmp_path, capsys):
    """`--text-column` on the command line: the vocabulary from a Parquet column `body` is the text file's,
    byte for byte; `--text-field` (the old JSONL flag) is the same option."""
    path, docs = shakespeare
    pq.write_table(pa.table({"title": ["x"] * len(docs), "body": docs}), tmp_path / "c.parquet")
    assert main(["vocab", "--input", str(path), "--output", str(tmp_path / "v-txt"), "--vocab-size", "1500"]) == 0
    assert main(["vocab", "--input", str(tmp_path / "c.parquet"), "--text-column", "body", "--output",
                 str(tmp_path / "v-pq"), "--vocab-size", "1500"]) == 0
    assert (tmp_path / "v-pq" / "vocab.txt").read_bytes() == (tmp_path / "v-txt" / "vocab.txt").read_bytes()
    # without the option: the missing column is one line naming the file, the column and the columns there are
    assert main(["prepare", "--input", str(tmp_path / "c.parquet"), "--output", str(tmp_path / "p"),
                 "--vocab-file", TINY_VOCAB]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'c.parquet'} has no column 'text' (expected a string column); its columns: title, body; " \
           "name the text column with --text-column" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("kind", ["dictionary", "string_view"])
def test_dictionary_encoded_and_string_view_text_columns(tmp_path, capsys, kind):
    """A text column stored dictionary-encoded (a pandas category column, Spark, Arrow's `dictionary_encode`) or as
    string_view (what polars writes to Arrow IPC files) is a string column: read it like a plain one. Before:
    exit 1 with a traceback (`ArrowNotImplementedError: Function 'binary_length' has no kernel ...`) in prepare
    and vocab, for Parquet and Arrow alike."""
    if kind == "string_view" and not hasattr(pa, "string_view"):
        pytest.skip(f"pyarrow {pa.__version__} has no string_view")
    texts = [f"Document {i % 7} of the {kind} test. It has a second sentence too." for i in range(40)] + [None]
    plain = pa.table({"text": pa.array(texts, pa.string())})
    special = pa.array(texts).dictionary_encode() if kind == "dictionary" else pa.array(texts, pa.string_view())
    pq.write_table(plain, tmp_path / "plain.parquet")
    pq.write_table(pa.table({"text": special}), tmp_path / "t.parquet")
    assert pq.read_schema(tmp_path / "t.parquet").field("text").type == special.type  # read back as written
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), pa.schema([("text", special.type)])) as w:
        w.write_table(pa.table({"text": special}))
    common = ["--vocab-file", TINY_VOCAB, "--workers", "1", "--masking", "none", "--heldout-fraction", "0"]
    assert main(["prepare", "--input", str(tmp_path / "plain.parquet"), "--output", str(tmp_path / "p-plain"),
                 *common]) == 0
    reference = json.loads((tmp_path / "p-plain" / "stats.json").read_text())
    for name in ("t.parquet", "t.arrow"):
        out = tmp_path / f"p-{name}"
        assert main(["prepare", "--input", str(tmp_path / name), "--output", str(out), *common]) == 0, name
        stats = json.loads((out / "stats.json").read_text())
        assert [stats[k] for k in ("num_documents", "num_tokens", "input_bytes")] == \
               [reference[k] for k in ("num_documents", "num_tokens", "input_bytes")], name
        assert stats["num_documents"] == 40 and stats["input_bytes"] == sum(len(t.encode()) for t in texts[:-1])
        assert stats["skipped"]["problems"] == {str(tmp_path / name): {"rows_without_text": 1}}
        assert [v for k, v in digest(out).items() if "shards" in k] == \
               [v for k, v in digest(tmp_path / "p-plain").items() if "shards" in k], name
    assert main(["vocab", "--input", str(tmp_path / "t.arrow"), "--output", str(tmp_path / "v"),
                 "--vocab-size", "100"]) == 0
    assert main(["vocab", "--input", str(tmp_path / "plain.parquet"), "--output", str(tmp_path / "v-plain"),
                 "--vocab-size", "100"]) == 0
    assert (tmp_path / "v" / "vocab.txt").read_bytes() == (tmp_path / "v-plain" / "vocab.txt").read_bytes()


# ----------------------------------------------------------------------------------------------- bad input

def test_wrong_column_type_nulls_and_damaged_files(tmp_path):
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(UserError) as e:
        raw_texts([tmp_path / "ints.parquet"])
    assert str(e.value).startswith(f"{tmp_path / 'ints.parquet'}: column 'text' is int64, expected a string column")

    pq.write_table(pa.table({"text": ["One document here.", None, "Another one.", None]}), tmp_path / "n.parquet")
    report = SkipReport()
    docs = list(iter_raw_documents([str(tmp_path / "n.parquet")], CorpusConfig(), report))
    assert [d.text for d in docs] == ["One document here.", "Another one."]
    assert report.problems() == {str(tmp_path / "n.parquet"): {"rows_without_text": 2}}

    whole = (tmp_path / "n.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "fake.arrow").write_bytes(b"this is not an arrow file\n" * 10)
    for name, what in (("cut.parquet", "Parquet"), ("fake.arrow", "Arrow (IPC stream or file)")):
        with pytest.raises(UserError) as e:
            raw_texts([tmp_path / name])
        assert str(e.value).startswith(f"{tmp_path / name} is not a readable {what} file: ")


def test_arrow_ipc_stream_and_file_formats(tmp_path):
    """A single .arrow file: an IPC stream (what `datasets` writes) or the IPC file format (Feather v2)."""
    table = pa.table({"n": list(range(600)), "text": [f"Document {i} of the arrow test." for i in range(600)]})
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=100)
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=100)
    assert raw_texts([tmp_path / "s.arrow"]) == raw_texts([tmp_path / "f.arrow"]) == table.column("text").to_pylist()


def test_incomplete_datasets_folder_and_empty_parquet(tmp_path):
    _dataset(["A first document of the folder.", "A second one."]).save_to_disk(str(tmp_path / "ds"))
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    arrow.unlink()
    with pytest.raises(UserError, match=f"lists {arrow}, which do not exist"):
        resolve_inputs([str(tmp_path / "ds")])
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    report = SkipReport()
    assert list(iter_raw_documents([str(tmp_path / "empty.parquet")], CorpusConfig(), report)) == []
    assert report.problems() == {str(tmp_path / "empty.parquet"): {"empty_files": 1}}


def test_truncated_zst_keeps_what_was_read_and_says_so(shakespeare, tmp_path):
    path, docs = shakespeare
    data = _zst_frames(path.read_bytes(), frames=4)
    (tmp_path / "cut.txt.zst").write_bytes(data[: int(len(data) * 0.6)])  # inside the third of four frames
    report = SkipReport()
    got = [d.text for d in iter_raw_documents([str(tmp_path / "cut.txt.zst")], CorpusConfig(), report)]
    assert report.problems() == {str(tmp_path / "cut.txt.zst"): {"truncated_files": 1}}
    assert len(docs) // 3 < len(got) < len(docs)  # two whole frames at least
    assert got[:-1] == docs[: len(got) - 1]  # all but the last (cut) document as in the whole file
    assert docs[len(got) - 1].startswith(got[-1])


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_truncated_gz_and_xz_keep_the_text_before_the_cut(shakespeare, tmp_path, suffix):
    """A cut .gz/.xz keeps (at least) every document that reading the stream in 4 KiB steps can recover: reading
    in large blocks must not drop the block that the cut ends."""
    import lzma
    path, docs = shakespeare
    module = gzip if suffix == ".gz" else lzma
    data = module.compress(path.read_bytes())
    cut = tmp_path / f"cut.txt{suffix}"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    recoverable = bytearray()
    with module.open(cut) as f, pytest.raises(EOFError):
        while block := f.read(4096):
            recoverable += block
    (tmp_path / "prefix.txt").write_bytes(bytes(recoverable))
    reference = raw_texts([tmp_path / "prefix.txt"])
    assert len(docs) // 3 < len(reference) < len(docs)
    report = SkipReport()
    got = [d.text for d in iter_raw_documents([str(cut)], CorpusConfig(), report)]
    assert report.problems() == {str(cut): {"truncated_files": 1}}
    assert len(got) >= len(reference) - 1 and got[: len(reference) - 1] == reference[:-1] == docs[: len(reference) - 1]


@pytest.mark.parametrize("name,kind", [("plain.txt.gz", "gzip"), ("plain.xml.bz2", "bzip2"), ("plain.txt.xz", "xz"),
                                       ("plain.jsonl.zst", "zstd")])
def test_a_file_that_is_not_what_its_suffix_says_is_one_clear_error(shakespeare, tmp_path, name, kind):
    """Plain text named .gz was counted as an empty, truncated file and dropped whole, exit 0."""
    path = tmp_path / name
    path.write_bytes(shakespeare[0].read_bytes()[:20000])
    with pytest.raises(UserError) as e:
        raw_texts([path])
    assert str(e.value).startswith(f"input {path} is not {kind} data (")
    assert "decompress or rename it" in str(e.value)


def test_a_damaged_compressed_file_is_an_error_not_a_truncation(shakespeare, tmp_path, capsys):
    """A full-length file with damaged bytes in its middle was "truncated" with a warning and exit 0, its rest
    (half of its documents) lost; now one line naming the file and the byte, and nothing is prepared."""
    path, docs = shakespeare
    data = bytearray(bz2.compress(path.read_bytes()))
    middle = len(data) // 2
    data[middle:middle + 100] = bytes(b ^ 0xFF for b in data[middle:middle + 100])
    (tmp_path / "damaged.txt.bz2").write_bytes(bytes(data))
    zst = bytearray(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(path.read_bytes()))
    zst[len(zst) // 2] ^= 0x01  # no decoding error but the frame's checksum
    (tmp_path / "damaged.txt.zst").write_bytes(bytes(zst))
    for name in ("damaged.txt.bz2", "damaged.txt.zst"):
        damaged = tmp_path / name
        with pytest.raises(UserError) as e:
            raw_texts([damaged])
        assert str(e.value).startswith(f"input {damaged} is damaged at byte ")
        assert f"of {damaged.stat().st_size:,} (" in str(e.value) and "download or copy it again" in str(e.value)
    out = tmp_path / "prepared"
    args = ["prepare", "--input", str(path), str(tmp_path / "damaged.txt.bz2"), "--output", str(out),
            "--vocab-file", TINY_VOCAB, "--masking", "dynamic"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "damaged.txt.bz2 is damaged at byte" in err[-1] and not out.exists()


def test_a_json_array_is_named_as_one(tmp_path):
    """A JSON array was read as one JSON Lines line without a text field (or as lines of invalid JSON) and skipped,
    with advice to name the text field."""
    docs = [{"text": f"Document number {i} of the array."} for i in range(3)]
    (tmp_path / "one-line.json").write_text(json.dumps(docs))
    (tmp_path / "pretty.json").write_text(json.dumps(docs, indent=2))
    for name in ("one-line.json", "pretty.json"):
        with pytest.raises(UserError) as e:
            raw_texts([tmp_path / name])
        assert str(e.value).startswith(f"{tmp_path / name} is a JSON array, not JSON Lines")
        assert f"jq -c '.[]' {name}" in str(e.value)


def test_a_glob_into_a_datasets_folder_reads_the_folder(tmp_path):
    """`hub/ds/*` passed state.json and dataset_info.json on as JSON Lines corpus files (bad_json_lines warnings)."""
    docs = [f"Document {i} of the saved dataset." for i in range(30)]
    _dataset(docs).save_to_disk(str(tmp_path / "ds"))
    files = resolve_inputs([str(tmp_path / "ds" / "*")])
    assert files and all(f.endswith(".arrow") for f in files)
    report = SkipReport()
    assert [d.text for d in iter_raw_documents(files, CorpusConfig(), report)] == docs
    assert report.problems() == {}


def test_missing_extra_is_one_line_saying_what_to_install(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["Some text."]}), tmp_path / "c.parquet")
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"Some text.\n"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "zstandard", None)
    for name, package in (("c.parquet", "pyarrow"), ("c.txt.zst", "zstandard")):
        with pytest.raises(UserError) as e:
            raw_texts([tmp_path / name])
        assert str(e.value).startswith(f"reading {tmp_path / name} needs ")
        assert package in str(e.value) and "pip install 'bertrain[data]'" in str(e.value)


# ----------------------------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("large_row_groups", [False, True], ids=["row-group-read", "row-group-streamed"])
def test_parquet_is_read_a_batch_at_a_time_with_progress(tmp_path, monkeypatch, large_row_groups):
    """The reader yields a record batch at a time: after the first document the progress stands at 0, after the
    first batch's documents at the end of that batch; at the end it is the file's size (what `prepare`'s progress
    line shows). The same whether a row group is read whole or (a large one) streamed."""
    from bertrain.data import tables
    from bertrain.data.tables import BATCH_ROWS

    if large_row_groups:
        monkeypatch.setattr(tables, "_LARGE_ROW_GROUP", 0)

    docs = [f"Document number {i} of the streaming test." for i in range(10 * BATCH_ROWS)]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=2 * BATCH_ROWS)
    size = path.stat().st_size
    with Progress("reading", bar=False) as progress:
        it = iter_raw_documents([str(path)], CorpusConfig(), SkipReport(), progress)
        texts = [next(it).text]
        assert progress.value == 0  # the first batch is not done yet
        texts += [next(it).text for _ in range(BATCH_ROWS)]
        assert progress.value == size * BATCH_ROWS // len(docs)  # one batch read
        texts += [d.text for d in it]
    assert texts == docs
    assert progress.total == size and progress.value == size
