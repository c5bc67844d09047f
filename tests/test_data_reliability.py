"""Trustworthy data commands (issue 12, data side): a reproducible vocabulary, strict input decoding, one-line write
errors that keep what can be kept, locked outputs that are moved aside (never deleted), progress and no floods.

Each test names the fault or bad input it tries; RELIABILITY.md lists them with what the user sees."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, trainers

import bertrain.data.prepare as prep
import bertrain.data.progress as progress_mod
import bertrain.data.tokenizer as tokmod
from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.progress import Progress
from bertrain.data.readers import CorpusConfig, SkipReport, iter_documents
from bertrain.data.store import ShardWriter, TokenStore
from bertrain.data.tokenizer import SPECIAL_TOKENS, VOCAB_STATS, WordCounter, _bert_pipeline, train_vocab
from bertrain.utils.errors import OutputError, UserError
from bertrain.utils.rundir import OutputLock, lock_path
from conftest import REPO, shared_file
from helpers import EDGE_CASES, TINY_VOCAB, digest, one_line_error, prepare_config, run_cli

# Pangrams: every letter in a handful of words, so many pairs are equally frequent (ties everywhere). HF's trainer
# alone gave another vocabulary on almost every run of this text.
PANGRAMS = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
            "Crazy Fredrick bought many very exquisite opal jewels. We promptly judged antique ivory buckles.\n\n") * 3
LATIN1_TEXT = ("Le café est très bon à Noël. Une phrase en français, déjà écrite.\n\n"
               "Ça coûte cher, dit l'élève naïf. Où est la forêt?\n\n") * 20




def vocab_in_subprocess(inputs: list[str], out: Path, threads: int, hashseed: int, *extra: str) -> bytes:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), PYTHONHASHSEED=str(hashseed),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "bertrain.cli", "vocab", "--input", *inputs, "--output", str(out),
                    *extra], check=True, env=env, capture_output=True)
    return (out / "vocab.txt").read_bytes()


# ----------------------------------------------------------------------------------------------- 1. vocabulary

def test_vocab_byte_identical_across_processes_thread_counts_and_hash_seeds(tmp_path):
    """The tie-heavy pangram text and builtin:python-docs (the quickstart's vocab): two processes each, with
    different RAYON_NUM_THREADS and PYTHONHASHSEED, write the same bytes."""
    (tmp_path / "pangrams.txt").write_text(PANGRAMS)
    for name, inputs, extra in (("p", [str(tmp_path / "pangrams.txt")], ["--vocab-size", "120"]),
                                ("d", ["builtin:python-docs"], ["--vocab-size", "8192"])):
        a = vocab_in_subprocess(inputs, tmp_path / f"{name}1", 1, 0, *extra)
        b = vocab_in_subprocess(inputs, tmp_path / f"{name}2", 4, 12345, *extra)
        assert a == b, name
        assert a.decode().splitlines()[:5] == list(SPECIAL_TOKENS)


def test_vocab_byte_identical_on_tiny_shakespeare(tmp_path):
    path = str(shared_file("text/tiny-shakespeare.txt"))
    a = vocab_in_subprocess([path], tmp_path / "a", 1, 0, "--vocab-size", "8000")
    b = vocab_in_subprocess([path], tmp_path / "b", 8, 1, "--vocab-size", "8000")
    assert a == b and len(a.decode().splitlines()) == 8000


def test_vocab_same_in_spirit_as_hf_trainer(tmp_path):
    """The deterministic trainer is HF's WordPiece trainer with fixed symbol ids: same size, special tokens
    first, then the alphabet and the ## continuations, and (ties aside) the same tokens as HF's trainer alone."""
    path = train_vocab(["builtin:python-docs"], tmp_path / "v", vocab_size=3000)
    ours = path.read_text().splitlines()
    assert len(ours) == 3000 and ours[:5] == list(SPECIAL_TOKENS)
    assert all(t.startswith("##") for t in ours[ours.index("##a"): ours.index("##a") + 20])
    tok = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), True)
    tok.train_from_iterator((d.text for d in iter_documents(["builtin:python-docs"], CorpusConfig(), SkipReport())),
                            trainer=trainers.WordPieceTrainer(vocab_size=3000, min_frequency=2,
                                                              special_tokens=list(SPECIAL_TOKENS),
                                                              continuing_subword_prefix="##", show_progress=False))
    hf = set(tok.get_vocab())
    assert len(hf & set(ours)) >= 0.99 * len(hf)


def hf_words(texts: list[str], lower: bool) -> Counter:
    """The words HF's trainer counts: BertNormalizer + BertPreTokenizer on each text."""
    tok = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), lower)
    return Counter(w for text in texts
                   for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)))


def counted_words(texts: list[str], lower: bool) -> Counter:
    counter = WordCounter(lower)
    for text in texts:
        counter.add(text)
    return counter.words()


@pytest.mark.parametrize("lower", [True, False])
def test_word_counts_equal_hf_on_edge_cases(lower):
    texts = EDGE_CASES + [PANGRAMS, LATIN1_TEXT]
    assert counted_words(texts, lower) == hf_words(texts, lower)


@pytest.mark.parametrize("rel", ["text/tiny-shakespeare.txt", "wiki/enwiki-sample-pages-articles.xml.bz2"])
def test_word_counts_equal_hf_on_real_corpora(rel):
    texts = [d.text for d in iter_documents([str(shared_file(rel))], CorpusConfig(), SkipReport())]
    assert counted_words(texts, True) == hf_words(texts, True)


def test_main_job_data_side_reproducible(tmp_path):
    """The README main job's data: vocab (8192, builtin:python-docs) in two processes, then prepare (dynamic) on
    each: the token stores are byte-identical (the pretraining run on them is then the same, seeded)."""
    digests = []
    for i, threads in enumerate((1, 3)):
        vocab_in_subprocess(["builtin:python-docs"], tmp_path / f"v{i}", threads, i, "--vocab-size", "8192")
        prepare(prepare_config(tmp_path / f"d{i}", vocab_file=str(tmp_path / f"v{i}" / "vocab.txt"), masking="dynamic",
                    shard_tokens=1 << 25))
        digests.append(digest(tmp_path / f"d{i}"))
    assert digests[0] == digests[1]


def test_vocab_rerun_refused_unless_overwrite_which_moves_the_old_one_aside(tmp_path, capsys):
    out = tmp_path / "v"
    args = ("vocab", "--input", "builtin:python-docs", "--output", out, "--vocab-size", "500")
    code, stdout, _ = run_cli(capsys, *args)
    assert code == 0 and "0 invalid characters replaced" in stdout
    first = (out / "vocab.txt").read_bytes()
    stats = json.loads((out / VOCAB_STATS).read_text())
    assert stats["settings"]["vocab_size"] == 500 and stats["num_tokens"] == 500
    code, _, err = run_cli(capsys, *args)
    line = one_line_error(err)
    assert code == 2 and "already exists" in line and "same inputs with the same settings" in line
    assert "--overwrite" in line and (out / "vocab.txt").read_bytes() == first
    code, _, err = run_cli(capsys, *args[:-1], "600")
    assert code == 2 and "other inputs or settings" in err
    assert run_cli(capsys, *args[:-1], "600", "--overwrite")[0] == 0
    assert len((out / "vocab.txt").read_text().splitlines()) == 600
    moved = list(out.glob("vocab.txt.replaced-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == first  # never deleted
    assert len(list(out.glob(f"{VOCAB_STATS}.replaced-*"))) == 1


# ----------------------------------------------------------------------------------------------- 2. decoding

def binary_file(tmp_path) -> Path:
    ls = Path("/bin/ls")
    if ls.is_file():
        return ls
    p = tmp_path / "blob.bin"
    p.write_bytes(bytes(range(256)) * 100)
    return p


@pytest.mark.parametrize("command", ["vocab", "prepare"])
def test_binary_input_refused_naming_file_and_offset(tmp_path, capsys, command):
    (tmp_path / "good.txt").write_text(PANGRAMS)
    binary = binary_file(tmp_path)
    extra = ["--vocab-file", TINY_VOCAB, "--workers", "1"] if command == "prepare" else []
    code, _, err = run_cli(capsys, command, "--input", tmp_path / "good.txt", binary, "--output", tmp_path / "o",
                           *extra)
    line = one_line_error(err)
    assert code == 2 and str(binary) in line and "not text" in line and "NUL byte at byte offset" in line
    assert "--encoding" in line
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_binary_without_nul_bytes_refused(tmp_path):
    blob = tmp_path / "random.txt"
    blob.write_bytes(bytes(range(128, 256)) * 50 + b"\n")
    with pytest.raises(UserError, match=r"not utf-8 text: .* invalid .*byte offset 0"):
        list(iter_documents([str(blob)], CorpusConfig(), SkipReport()))


def test_latin1_refused_then_read_exactly_with_encoding(tmp_path, capsys):
    """latin-1 read as UTF-8 used to lose every accented letter ("café" -> "caf") with a count warning. Now it is
    refused; with --encoding latin-1 (or cp1252) it gives exactly what the same text in UTF-8 gives."""
    (tmp_path / "lat").mkdir()
    (tmp_path / "utf").mkdir()
    (tmp_path / "lat" / "fr.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (tmp_path / "utf" / "fr.txt").write_bytes(LATIN1_TEXT.encode("utf-8"))
    code, _, err = run_cli(capsys, "prepare", "--input", tmp_path / "lat", "--output", tmp_path / "o",
                           "--vocab-file", TINY_VOCAB, "--workers", "1", "--masking", "none")
    line = one_line_error(err)
    assert code == 2 and "fr.txt is not utf-8 text" in line and "byte offset 6 (b'Le caf\\xe9" in line
    assert "--encoding latin-1" in line
    for enc in ("latin-1", "cp1252"):
        a = prepare(prepare_config(tmp_path / f"lat-{enc}", inputs=[str(tmp_path / "lat")],
                                   corpus=CorpusConfig(encoding=enc), masking="none"))
        assert a["encoding"] == enc and a["replaced_characters"] == 0
        prepare(prepare_config(tmp_path / f"utf-{enc}", inputs=[str(tmp_path / "utf")], masking="none"))
        assert [v for k, v in digest(tmp_path / f"lat-{enc}").items() if "shards" in k] == \
               [v for k, v in digest(tmp_path / f"utf-{enc}").items() if "shards" in k]
    a = train_vocab([str(tmp_path / "lat")], tmp_path / "vl", vocab_size=200, lowercase=False,
                    corpus=CorpusConfig(encoding="latin-1"))
    b = train_vocab([str(tmp_path / "utf")], tmp_path / "vu", vocab_size=200, lowercase=False)
    assert a.read_bytes() == b.read_bytes() and "é" in a.read_text()
    with pytest.raises(ValueError, match="convert the files to UTF-8"):
        PrepareConfig(inputs=["x"], output="o", vocab_file=TINY_VOCAB, corpus=CorpusConfig(encoding="utf-16"))
    with pytest.raises(ValueError, match="unknown encoding"):
        CorpusConfig(encoding="no-such-codec")


def test_few_invalid_bytes_replaced_and_counted_in_stats_and_vocab_output(tmp_path, capsys):
    text = PANGRAMS.encode() * 5 + b"One bad \xff byte and a cut \xe2\x82 sequence here.\n"  # 2 of ~2.6k bytes
    (tmp_path / "a.txt").write_bytes(text)
    stats = prepare(prepare_config(tmp_path / "o", inputs=[str(tmp_path / "a.txt")], masking="none"))
    assert stats["replaced_characters"] == 2
    assert stats["skipped"]["problems"][str(tmp_path / "a.txt")]["replaced_characters"] == 2
    assert json.loads((tmp_path / "o" / "stats.json").read_text())["replaced_characters"] == 2
    code, stdout, _ = run_cli(capsys, "vocab", "--input", tmp_path / "a.txt", "--output", tmp_path / "v",
                              "--vocab-size", "100")
    assert code == 0 and "2 invalid characters replaced" in stdout
    assert json.loads((tmp_path / "v" / VOCAB_STATS).read_text())["replaced_characters"] == 2


def test_a_utf8_bom_starting_a_jsonl_file_keeps_its_first_document(tmp_path, capsys):
    """Windows tools (PowerShell, Excel, Notepad) start UTF-8 files with a byte order mark. Before, the first line
    of such a JSONL file was 'not valid JSON' and its document was skipped (exit 0, one warning), and
    `--encoding utf-8-sig` was refused as not ASCII-compatible."""
    docs = [{"text": f"Document {i}. " + PANGRAMS.split("\n")[0]} for i in range(3)]
    lines = "".join(json.dumps(d) + "\n" for d in docs)
    (tmp_path / "bom").mkdir()
    (tmp_path / "plain").mkdir()
    (tmp_path / "bom" / "c.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "plain" / "c.jsonl").write_bytes(lines.encode())
    for encoding in ("utf-8", "utf-8-sig"):
        report = SkipReport()
        read = list(iter_documents([str(tmp_path / "bom")], CorpusConfig(encoding=encoding), report))
        assert [d.sentences[0] for d in read] == ["Document 0.", "Document 1.", "Document 2."], encoding
        assert report.totals() == {}, encoding
    code, _, err = run_cli(capsys, "prepare", "--input", tmp_path / "bom", "--output", tmp_path / "o-bom",
                           "--vocab-file", TINY_VOCAB, "--workers", "1", "--masking", "none")
    assert code == 0 and "not valid JSON" not in err
    prepare(prepare_config(tmp_path / "o-plain", inputs=[str(tmp_path / "plain")], masking="none"))
    assert json.loads((tmp_path / "o-bom" / "stats.json").read_text())["num_documents"] == 3
    assert [v for k, v in digest(tmp_path / "o-bom").items() if "shards" in k] == \
           [v for k, v in digest(tmp_path / "o-plain").items() if "shards" in k]


def test_lone_surrogate_escapes_in_jsonl_are_replaced_and_counted(tmp_path, capsys):
    """JSON's "\\ud83d" escape without its pair (scraped text cut inside an emoji) decodes to half a character that
    UTF-8 cannot hold. Before, prepare and vocab stopped with `'utf-8' codec can't encode character '\\ud83d' ...`
    (naming no file or line, after reading everything before it); now it is replaced like an invalid byte and
    counted, and a complete pair is the emoji it encodes."""
    f = tmp_path / "scraped.jsonl"
    f.write_text(json.dumps({"text": "A post cut inside an emoji \ud83d here. " + PANGRAMS.split("\n")[0]}) + "\n"
                 + json.dumps({"text": "A whole emoji \U0001F600 stays. " + PANGRAMS.split("\n")[0]}) + "\n")
    assert "\\ud83d\\ude00" in f.read_text() and f.read_text().count("\\ud83d") == 2  # JSON escapes both
    report = SkipReport()
    docs = list(iter_documents([str(f)], CorpusConfig(), report))
    assert docs[0].sentences[0] == "A post cut inside an emoji here."
    assert docs[1].sentences[0] == "A whole emoji \U0001F600 stays."
    assert report.counts[str(f)]["replaced_characters"] == 1
    code, _, err = run_cli(capsys, "prepare", "--input", f, "--output", tmp_path / "o", "--vocab-file", TINY_VOCAB,
                           "--workers", "1", "--masking", "none")
    assert code == 0, err
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["num_documents"] == 2 and stats["replaced_characters"] == 1
    assert stats["skipped"]["problems"] == {str(f): {"replaced_characters": 1}}
    code, stdout, err = run_cli(capsys, "vocab", "--input", f, "--output", tmp_path / "v", "--vocab-size", "100")
    assert code == 0 and "1 invalid characters replaced" in stdout, err


def test_character_cut_at_the_end_of_a_file_is_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(PANGRAMS.encode() * 3 + b"ends in a cut character \xc3")
    report = SkipReport()
    list(iter_documents([str(tmp_path / "a.txt")], CorpusConfig(), report))
    assert report.totals()["replaced_characters"] == 1


# ----------------------------------------------------------------------------------------------- 3. write errors

def enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def disk_full_at_shard(monkeypatch, name: str) -> None:
    """ShardWriter.add fails with ENOSPC when it writes the shard `name` (until monkeypatch.undo())."""
    real_add = ShardWriter.add

    def add(self, *a):
        if self.path.name == name:
            enospc()
        return real_add(self, *a)

    monkeypatch.setattr(ShardWriter, "add", add)


def test_prepare_disk_full_keeps_finished_shards_resumable(tmp_path, monkeypatch, capsys, caplog):
    """ENOSPC while writing the 2nd shard: one line (what, free space, kept what, how to free it); the unfinished
    shard is deleted, the finished one stays in data.partial, and the same command then resumes from it."""
    disk_full_at_shard(monkeypatch, "shard-00001.bts")
    out = tmp_path / "data"
    argv = ("prepare", "--input", "builtin:python-docs", "--output", out, "--vocab-file", TINY_VOCAB, "--workers", "1",
            "--dupe-factor", "2", "--shard-tokens", "30000")
    code, _, err = run_cli(capsys, *argv)
    line = one_line_error(err)
    assert code == 2 and "writing the token shard" in line and "shard-00001.bts" in line
    assert "No space left on device" in line and "MiB free on" in line and "needed" in line
    assert "kept 1 finished shard (" in line and "re-run the same command to resume" in line and "delete" in line
    partial = tmp_path / "data.partial"
    assert sorted(p.name for p in (partial / "shards").iterdir()) == ["shard-00000.bts"]
    assert not out.exists()
    monkeypatch.undo()
    with caplog.at_level(logging.INFO):
        assert run_cli(capsys, *argv)[0] == 0
    assert "resuming" in caplog.text and "1 shards" in caplog.text
    assert not partial.exists() and TokenStore(out).num_documents == 79


def test_prepare_disk_full_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    prepare(prepare_config(ref))
    disk_full_at_shard(monkeypatch, "shard-00002.bts")
    with pytest.raises(OutputError, match="No space left"):
        prepare(prepare_config(tmp_path / "data"))
    monkeypatch.undo()
    prepare(prepare_config(tmp_path / "data"))
    assert digest(tmp_path / "data") == digest(ref)


def test_prepare_disk_too_small_for_static_instances_refused_before_writing(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(prep.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OutputError) as e:
        prepare(prepare_config(tmp_path / "data"))
    msg = str(e.value)
    assert "writing the static instances" in msg and "No space left" in msg and "MiB needed" in msg
    assert "finished shards" in msg
    partial = tmp_path / "data.partial"
    assert not list(partial.rglob("*.tmp")) and (partial / "store.json").is_file()


def test_prepare_disk_full_while_workers_write_instances_removes_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(prep.os, "pwrite", enospc)
    with pytest.raises(OutputError, match="writing the static instances.*No space left"):
        prepare(prepare_config(tmp_path / "data"))
    assert not list((tmp_path / "data.partial").rglob(".instances.bin.tmp"))


def test_vocab_disk_full_leaves_the_old_vocab_untouched(tmp_path, monkeypatch):
    out = tmp_path / "v"
    train_vocab(["builtin:python-docs"], out, vocab_size=300)
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir())
    monkeypatch.setattr(tokmod, "atomic_write_text", enospc)
    with pytest.raises(OutputError) as e:
        train_vocab(["builtin:python-docs"], out, vocab_size=400, overwrite=True)
    msg = str(e.value)
    assert "writing the vocabulary" in msg and "No space left" in msg and "MiB free" in msg
    assert "earlier vocab.txt there is unchanged" in msg
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before


def test_output_where_a_file_is_in_the_way(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for argv in (("vocab", "--input", "builtin:python-docs"),
                 ("prepare", "--input", "builtin:python-docs", "--vocab-file", TINY_VOCAB)):
        code, _, err = run_cli(capsys, *argv, "--output", tmp_path / "file" / "out")
        line = one_line_error(err)
        assert code == 2 and "a file is in the way" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only (0o500) folder anyway")
def test_read_only_output_folder(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for argv in (("vocab", "--input", "builtin:python-docs"),
                     ("prepare", "--input", "builtin:python-docs", "--vocab-file", TINY_VOCAB)):
            code, _, err = run_cli(capsys, *argv, "--output", ro / "out")
            line = one_line_error(err)
            assert code == 2 and "Permission denied" in line and "no permission" in line
    finally:
        ro.chmod(0o700)


def test_missing_input_empty_folder_and_folder_without_text(tmp_path, capsys):
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".only-hidden.txt").write_text("x")
    (tmp_path / "empties").mkdir()
    (tmp_path / "empties" / "a.txt").write_bytes(b"")
    (tmp_path / "empties" / "b.txt").write_bytes(b"\n\n   \n")
    cases = [(tmp_path / "missing.txt", "does not exist"), (tmp_path / "hidden", "contains no files"),
             (tmp_path / "empties", "no text")]
    for command, extra in (("vocab", []), ("prepare", ["--vocab-file", TINY_VOCAB, "--workers", "1"])):
        for path, gist in cases:
            code, _, err = run_cli(capsys, command, "--input", path, "--output", tmp_path / "o", *extra)
            line = one_line_error(err)
            assert code == 2 and gist in line, line
            assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_unreadable_vocab_file_for_prepare(tmp_path, capsys):
    code, _, err = run_cli(capsys, "prepare", "--input", "builtin:python-docs", "--output", tmp_path / "o",
                           "--vocab-file", binary_file(tmp_path))
    assert code == 2 and "is not UTF-8 text" in one_line_error(err)
    (tmp_path / "v.txt").write_text("a\nb\n")
    code, _, err = run_cli(capsys, "prepare", "--input", "builtin:python-docs", "--output", tmp_path / "o",
                           "--vocab-file", tmp_path / "v.txt")
    assert code == 2 and "lacks the special tokens" in one_line_error(err)


def test_prepare_follows_the_casing_the_vocab_was_trained_with(tmp_path, capsys):
    """A cased vocabulary (`vocab --cased`) is prepared cased by default; asking for lower-casing is refused before
    any output exists (it would silently split every capitalised word); a vocab.txt replaced after training (its
    record describes another file) or one without a record keeps the lower-case default."""
    vocab = tmp_path / "v"
    assert run_cli(capsys, "vocab", "--input", "builtin:python-docs", "--output", vocab, "--vocab-size", "800",
                   "--cased")[0] == 0
    common = ("--input", "builtin:python-docs", "--vocab-file", vocab / "vocab.txt", "--masking", "dynamic",
              "--workers", "1")
    assert run_cli(capsys, "prepare", *common, "--output", tmp_path / "d")[0] == 0
    assert json.loads((tmp_path / "d" / "stats.json").read_text())["tokenizer_identity"].startswith(
        "wordpiece-800-cased-")
    code, _, err = run_cli(capsys, "prepare", *common, "--output", tmp_path / "lower", "--do-lower-case")
    line = one_line_error(err)
    assert code == 2 and "trained cased" in line and "do_lower_case" in line and not (tmp_path / "lower").exists()
    shutil.copy(TINY_VOCAB, vocab / "vocab.txt")  # no longer the file the record describes
    assert tokmod.recorded_casing(vocab / "vocab.txt") is None
    assert run_cli(capsys, "prepare", *common, "--output", tmp_path / "other")[0] == 0
    assert "-uncased-" in json.loads((tmp_path / "other" / "stats.json").read_text())["tokenizer_identity"]


def test_bad_input_after_finished_shards_removes_the_partial_build(tmp_path):
    """A binary among the inputs, found after shards were finished: the inputs must change to get past it (which
    restarts the build anyway), so the partial build is removed, and nothing earlier is touched."""
    (tmp_path / "in").mkdir()
    shutil.copy(binary_file(tmp_path), tmp_path / "in" / "zz-binary.txt")
    out = tmp_path / "data"
    prepare(prepare_config(out, masking="none"))
    before = digest(out)
    with pytest.raises(UserError, match="zz-binary.txt is not text"):
        prepare(prepare_config(out, inputs=["builtin:python-docs", str(tmp_path / "in")], overwrite=True))
    assert not (tmp_path / "data.partial").exists() and digest(out) == before


def test_inspect_interrupted_or_damaged_folder_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "data"
    disk_full_at_shard(monkeypatch, "shard-00001.bts")
    with pytest.raises(OutputError):
        prepare(prepare_config(out))
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "inspect", out)
    assert code == 2 and "interrupted prepare" in one_line_error(err)
    prepare(prepare_config(out, masking="none"))
    (out / "stats.json").write_text("{not json")
    code, _, err = run_cli(capsys, "inspect", out)
    line = one_line_error(err)
    assert code == 2 and "stats.json" in line and "re-run prepare" in line


def test_inspect_verify_checks_the_heldout_shards_too(tmp_path, capsys):
    """A flipped byte in a held-out shard passed `inspect --verify` and failed only in `pretrain`."""
    out = tmp_path / "data"
    prepare(prepare_config(out, heldout_fraction=0.1, heldout_min_documents=4, masking="dynamic"))
    shard = next((out / "heldout" / "shards").glob("shard-*.bts"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert run_cli(capsys, "inspect", out)[0] == 0  # without --verify the checksums are not read
    code, _, err = run_cli(capsys, "inspect", out, "--verify")
    line = one_line_error(err)
    assert code == 2 and "corrupt shard" in line and str(shard) in line


def test_kill_9_in_the_middle_of_a_shard_then_resume_gives_the_same_bytes(tmp_path):
    """SIGKILL (no cleanup runs) while a shard is half written: no output, a partial folder with a stray temporary
    shard; the same command then resumes (the stray file and the unrecorded shard are redone) to the bytes of an
    uninterrupted run, and takes over the dead process's lock."""
    out = tmp_path / "data"
    script = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from bertrain.data.store import ShardWriter\n"
        "from bertrain.data.prepare import prepare\n"
        "from helpers import prepare_config\n"
        "real = ShardWriter.add\n"
        "def add(self, *a):\n"
        "    real(self, *a)\n"
        "    if self.path.name == 'shard-00002.bts':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "ShardWriter.add = add\n"
        f"prepare(prepare_config({str(out)!r}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    partial = tmp_path / "data.partial"
    assert not out.exists() and (partial / "shards" / ".shard-00002.bts.tmp").exists()
    prepare(prepare_config(out))
    ref = tmp_path / "ref"
    prepare(prepare_config(ref))
    assert digest(out) == digest(ref) and not partial.exists()


def test_mistyped_input_keeps_an_interrupted_build(tmp_path, monkeypatch):
    """An interrupted build, then the command re-run with a typo in an input: refused before the partial folder is
    touched; the corrected command then resumes it."""
    out = tmp_path / "data"
    disk_full_at_shard(monkeypatch, "shard-00002.bts")
    with pytest.raises(OutputError):
        prepare(prepare_config(out))
    monkeypatch.undo()
    partial = tmp_path / "data.partial"
    before = digest(partial)
    with pytest.raises(UserError, match="does not exist"):
        prepare(prepare_config(out, inputs=["builtin:python-docs", str(tmp_path / "typo.txt")]))
    assert digest(partial) == before
    processed = []
    real_tok = prep._tokenize_chunk
    monkeypatch.setattr(prep, "_tokenize_chunk", lambda c: processed.append(1) or real_tok(c))
    prepare(prepare_config(out))
    resumed = len(processed)
    prepare(prepare_config(tmp_path / "fresh"))
    assert 0 < resumed <= len(processed) - resumed - 2 and not partial.exists()  # 2 shards' chunks not redone


# ----------------------------------------------------------------------------------------------- 4. locks

def test_prepare_and_vocab_refused_while_another_process_holds_the_output(tmp_path):
    out = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from bertrain.utils.rundir import OutputLock\n"
        f"with OutputLock({str(out)!r}, 'prepare'):\n    print('locked', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,  # holds the lock until killed
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])))
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(UserError, match=rf"in use by `bertrain prepare` \(pid {holder.pid} on "):
            prepare(prepare_config(out))
        assert time.monotonic() - t0 < 5  # at once, not after a wait
        assert not (tmp_path / "data.partial").exists()
    finally:
        holder.kill()
        holder.wait()
    prepare(prepare_config(out, masking="none"))  # the dead holder's lock is taken over
    with OutputLock(tmp_path / "v", "vocab"):
        with pytest.raises(UserError, match=r"in use by `bertrain vocab` \(pid"):
            train_vocab(["builtin:python-docs"], tmp_path / "v", vocab_size=300)
    assert not (tmp_path / "v" / "vocab.txt").exists()
    assert lock_path(tmp_path / "v") == tmp_path / ".v.lock"


def test_prepare_overwrite_moves_the_old_output_aside(tmp_path):
    out = tmp_path / "data"
    prepare(prepare_config(out, masking="none"))
    old = digest(out)
    prepare(prepare_config(out, masking="dynamic", overwrite=True, seed=7))
    moved = list(tmp_path.glob("data.replaced-*"))
    assert len(moved) == 1 and digest(moved[0]) == old and (moved[0] / "stats.json").is_file()
    TokenStore(out)


def test_partial_build_of_another_command_is_discarded_with_its_static_instances(tmp_path, monkeypatch):
    """A build killed after its static instances were complete, then re-run with other inputs: nothing of the old
    partial folder (stale instances included) may end up in the new output."""
    out = tmp_path / "data"
    real = prep.atomic_write_json

    def die_at_stats(path, obj, *a, **k):
        if Path(path).name == "stats.json":
            raise KeyboardInterrupt
        return real(path, obj, *a, **k)

    monkeypatch.setattr(prep, "atomic_write_json", die_at_stats)
    with pytest.raises(KeyboardInterrupt):
        prepare(prepare_config(out))
    monkeypatch.setattr(prep, "atomic_write_json", real)
    (tmp_path / "small.txt").write_text(PANGRAMS * 20)
    stats = prepare(prepare_config(out, inputs=[str(tmp_path / "small.txt")]))
    ref = tmp_path / "ref"
    prepare(prepare_config(ref, inputs=[str(tmp_path / "small.txt")]))
    assert digest(out) == digest(ref) and stats["num_documents"] == 60


# ----------------------------------------------------------------------------------------------- 5. progress

def test_progress_log_lines_when_not_a_terminal(caplog):
    with caplog.at_level(logging.INFO), Progress("reading", total=4e6, interval=0, bar=False) as p:
        p.set(1e6)
        p.update(1e6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("reading: 2.0 MB of 4.0 MB (50%), ") and "MB/s" in lines[-1] and "s left" in lines[-1]


def test_prepare_and_vocab_report_progress_of_every_phase(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress_mod, "LOG_INTERVAL", 0.0)
    with caplog.at_level(logging.INFO):
        prepare(prepare_config(tmp_path / "d"))
        train_vocab(["builtin:python-docs"], tmp_path / "v", vocab_size=300)
    text = caplog.text
    assert "prepare: tokenizing:" in text and "(100%)" in text
    assert "prepare: static instances:" in text and "rows of" in text
    assert "vocab: reading:" in text and "training 300 WordPieces" in text and "vocab: trained in" in text


def test_per_file_warnings_capped_with_a_summary_line(tmp_path, caplog):
    (tmp_path / "in").mkdir()
    for i in range(25):
        (tmp_path / "in" / f"empty{i:02d}.txt").write_bytes(b"")
    (tmp_path / "in" / "good.txt").write_text(PANGRAMS)
    with caplog.at_level(logging.WARNING):
        prepare(prepare_config(tmp_path / "o", inputs=[str(tmp_path / "in")], masking="none"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 11 and "... and 15 more files with problems" in warnings[-1]
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert len(stats["skipped"]["problems"]) == 25  # every file is still listed
