"""``prepare``: tokens equal the tokenizer's ids + EOS, bytes independent of workers, resumable after kill -9,
complete-or-refused outputs, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import multiprocessing
import os
import re
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from _prepared import file_bytes, make_texts, make_tokenizer, write_jsonl, write_parquet
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_llmfast import DataError
from lightning_llmfast.data import PreparedBatches, PreparedDataset
from lightning_llmfast.data import layouts as layouts_module
from lightning_llmfast.data.packing import pack_lengths
from lightning_llmfast.data.prepare import PrepareConfig, prepare
from lightning_llmfast.data.prepared import in_validation, layout_files, permute
from lightning_llmfast.prepare import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tokenizer, 90 jsonl documents then 41 parquet rows (awkward sizes), and the reference token ids."""
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = make_tokenizer(root / "tok")
    texts_a, texts_b = make_texts(90, seed=1), make_texts(41, seed=2, max_words=200)
    inputs = (str(write_jsonl(root / "a.jsonl", texts_a)), str(write_parquet(root / "b.parquet", texts_b)))
    hf = AutoTokenizer.from_pretrained(tokenizer)
    reference = [hf(t, add_special_tokens=False)["input_ids"] + [hf.eos_token_id] for t in texts_a + texts_b]
    return {"root": root, "tokenizer": str(tokenizer), "inputs": inputs, "texts": texts_a + texts_b,
            "reference": reference, "hf": hf}  # fmt: skip


def _config(corpus: dict[str, object], output: Path, **kwargs: object) -> PrepareConfig:
    args = {"inputs": corpus["inputs"], "tokenizer": corpus["tokenizer"], "output": str(output), "seq_len": (16, 7),
            "val_fraction": 0.2, "chunk_docs": 9, "shard_bytes": 1500, "progress": False, **kwargs}  # fmt: skip
    return PrepareConfig(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prepared(corpus: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("prepared") / "out"
    prepare(_config(corpus, output, workers=1))
    return output


def test_every_document_is_the_tokenizers_ids_plus_eos_in_input_order(
    corpus: dict[str, object], prepared: Path
) -> None:
    dataset = PreparedDataset(prepared)
    reference = corpus["reference"]
    assert len(dataset) == len(reference) == 131
    assert dataset.dtype == np.uint16 and dataset.vocab_size == len(corpus["hf"])  # type: ignore[arg-type]
    for i, ids in enumerate(reference):  # type: ignore[arg-type]
        assert dataset[i].tolist() == ids, i
    assert dataset[3].tolist() == [dataset.eos_id]  # the empty document: EOS alone
    assert dataset[-1].tolist() == reference[-1] and [d.tolist() for d in dataset] == reference  # type: ignore[index]
    with pytest.raises(IndexError):
        dataset[131]
    manifest = dataset.manifest
    assert manifest["num_tokens"] == sum(map(len, reference)) == int(dataset.offsets[-1])  # type: ignore[arg-type]
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 131
    assert 0 < manifest["splits"]["val"]["documents"] < 131 * 0.4
    # shards of whole chunks (9 documents) that grow to 1500 bytes: fewer than the chunks, contiguous
    shards = manifest["shards"]
    assert 1 < len(shards) < -(-131 // 9) and all(s["tokens"] * 2 >= 1500 for s in shards[:-1])
    assert [s["first_document"] for s in shards] == np.cumsum([0] + [s["documents"] for s in shards[:-1]]).tolist()
    assert [s["first_token"] for s in shards] == np.cumsum([0] + [s["tokens"] for s in shards[:-1]]).tolist()
    assert all(s["documents"] % 9 == 0 for s in shards[:-1])
    # the packed layout of each split covers its documents whole, once, as consecutive pieces
    for seq_len in (7, 16):
        seen: dict[int, list[tuple[int, int]]] = {}
        for split in ("train", "val"):
            layout = dataset.layout(seq_len, split)
            assert layout.num_rows == manifest["layouts"][str(seq_len)][split]["rows"]
            for r in range(layout.num_rows):
                row = layout.row(r)
                assert 0 < sum(n for _, _, n in row) <= seq_len
                for d, s, n in row:
                    seen.setdefault(d, []).append((s, n))
        assert sorted(seen) == list(range(131))
        for d, pieces in seen.items():
            starts = sorted(pieces)
            assert [s for s, _ in starts] == list(range(0, len(reference[d]), seq_len))  # type: ignore[index]
            assert sum(n for _, n in starts) == len(reference[d])  # type: ignore[index]


def test_bos_and_every_input_kind_give_the_same_documents(corpus: dict[str, object], tmp_path: Path) -> None:
    texts = [t for t in corpus["texts"][:30] if t.strip() and "\n" not in t]  # type: ignore[index]
    hf = corpus["hf"]
    expected = [[hf.bos_token_id, *hf(t, add_special_tokens=False)["input_ids"], hf.eos_token_id] for t in texts]  # type: ignore[operator, union-attr]
    gz = tmp_path / "gz" / "c.jsonl.gz"
    gz.parent.mkdir()
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in texts[:10])
    (tmp_path / "lines.txt").write_text("\n".join(texts[10:20]) + "\n\n")
    arrow = tmp_path / "hf_dataset"
    arrow.mkdir()
    with pa.OSFile(str(arrow / "data-00000-of-00001.arrow"), "wb") as sink:
        table = pa.table({"body": texts[20:]})
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (arrow / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    for kind, inputs in (("mixed", (str(gz.parent), str(tmp_path / "lines.txt"), str(arrow))),):
        output = tmp_path / kind
        prepare(PrepareConfig(inputs=inputs, tokenizer=corpus["tokenizer"], output=str(output), text_key="body",  # type: ignore[arg-type]
                              lines=True, bos=True, seq_len=(8,), val_fraction=0, progress=False))  # fmt: skip
        dataset = PreparedDataset(output)
        assert [dataset[i].tolist() for i in range(len(dataset))] == expected
        assert dataset.layout(8, "val").num_rows == 0
    # a whole .txt file is one document
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "doc.txt").write_text("alpha\nbeta")
    prepare(PrepareConfig(inputs=(str(tmp_path / "whole"),), tokenizer=corpus["tokenizer"], output=str(tmp_path / "w"),  # type: ignore[arg-type]
                          seq_len=(4,), val_fraction=0, progress=False))  # fmt: skip
    assert PreparedDataset(tmp_path / "w")[0].tolist() == hf("alpha\nbeta", add_special_tokens=False)["input_ids"] + [  # type: ignore[operator]
        hf.eos_token_id  # type: ignore[union-attr]
    ]


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path: Path) -> None:
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        tmp_path / "tok"
    )
    texts = ["w69999 w3 w65536", "w70001", "w65534"]
    write_jsonl(tmp_path / "a.jsonl", texts)
    prepare(PrepareConfig(inputs=(str(tmp_path / "a.jsonl"),), tokenizer=str(tmp_path / "tok"),
                          output=str(tmp_path / "out"), seq_len=(4,), val_fraction=0, progress=False))  # fmt: skip
    dataset = PreparedDataset(tmp_path / "out")
    assert dataset.dtype == np.uint32 and dataset.vocab_size == 70_002
    assert [dataset[i].tolist() for i in range(3)] == [[70_001, 5, 65_538, 0], [1, 0], [65_536, 0]]


def test_one_or_two_workers_write_the_same_bytes(corpus: dict[str, object], prepared: Path, tmp_path: Path) -> None:
    prepare(_config(corpus, tmp_path / "two", workers=2))
    assert file_bytes(tmp_path / "two") == file_bytes(prepared)
    # an output already complete with the same settings is kept as it is
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "two").iterdir()}
    prepare(_config(corpus, tmp_path / "two", workers=2))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "two").iterdir()} == before


def test_a_chunk_also_ends_at_its_character_limit(
    corpus: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lightning_llmfast.data.prepare.CHUNK_SIZE", 500)
    prepare(_config(corpus, tmp_path / "out", chunk_docs=1000, shard_bytes=1))  # a shard per chunk
    dataset = PreparedDataset(tmp_path / "out")
    # a jsonl document counts the bytes of its line (parsed in a worker), a parquet one the characters of its text
    texts = corpus["texts"]  # type: ignore[index]
    sizes = [len(json.dumps({"id": i, "text": t}) + "\n") for i, t in enumerate(texts[:90])] + [
        len(t) for t in texts[90:]
    ]  # type: ignore[index]
    expected, used, count = [], 0, 0
    for size in sizes:
        used, count = used + size, count + 1
        if used >= 500:
            expected.append(count)
            used, count = 0, 0
    expected += [count] if count else []
    assert [shard["documents"] for shard in dataset.manifest["shards"]] == expected and len(expected) > 10
    assert dataset.manifest["settings"]["chunk_size"] == 500
    assert [d.tolist() for d in dataset] == corpus["reference"]


def test_kill_9_mid_run_then_the_same_command_ends_with_the_same_bytes(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "big.jsonl", make_texts(3000, seed=5, max_words=30))
    args = ["--input", str(tmp_path / "big.jsonl"), "--tokenizer", str(tokenizer), "--seq-len", "32",
            "--val-fraction", "0.1", "--chunk-docs", "20", "--workers", "2", "--no-progress"]  # fmt: skip
    killed = tmp_path / "killed"
    # the command in a forked process (no second interpreter start-up), with its own two worker processes
    proc = multiprocessing.get_context("fork").Process(target=main, args=([*args, "--output", str(killed)],))
    proc.start()
    partial, deadline = killed / ".partial", time.monotonic() + 120
    while len(list(partial.glob("chunk-*.json"))) < 10 and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    done = len(list(partial.glob("chunk-*.json")))
    assert proc.exitcode == -signal.SIGKILL and 10 <= done < 150, (proc.exitcode, done)
    assert not (killed / "manifest.json").exists()
    with pytest.raises(DataError, match=r"no manifest\.json, so the preparation did not finish"):
        PreparedDataset(killed)
    # the same command continues (here in-process, one worker: the bytes do not depend on it) and skips done chunks
    assert main([*args, "--output", str(killed), "--workers", "1"]) == 0
    assert main([*args, "--output", str(tmp_path / "whole"), "--workers", "1"]) == 0
    assert file_bytes(killed) == file_bytes(tmp_path / "whole")
    assert main(["--verify", str(killed)]) == 0


def test_verify_finds_flipped_bytes_and_a_truncated_shard_is_refused(
    corpus: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out"
    prepare(_config(corpus, output))
    shard = output / "tokens-00002.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    PreparedDataset(output)  # same size: only the checksum finds it
    assert main(["--verify", str(output)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: prepared dataset {output}: tokens-00002.bin does not match its sha256 in manifest.json (corrupted)"
    )
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"tokens-00002.bin has \d+ bytes, the manifest says \d+ \(truncated"):
        PreparedDataset(output)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: write_jsonl(d / "x.jsonl", ["a"]).open("a").write('{"text": "b"\n'), r"x.jsonl:2: malformed JSON"),
        (lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n'), r"x.jsonl:2: no field 'text'"),
        (lambda d: (d / "x.jsonl").write_text('{"text": 5}\n'), r"x.jsonl:1: field 'text' is int, not a string"),
        (lambda d: (d / "x.jsonl").write_text('{"text": null}\n'), r"x.jsonl:1: field 'text' is null"),
        (lambda d: (d / "x.jsonl").write_text("\n\n"), r"no document in the inputs .*x.jsonl.*: they are empty"),
        (lambda d: write_parquet(d / "x.parquet", ["a"]) and (d / "x.jsonl").unlink(), r"no column 'body'"),
        (lambda d: (d / "x.csv").write_text("a"), r"x.csv: unsupported file type"),
    ],
)
def test_bad_inputs_end_in_one_error_line(
    corpus: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, message: str
) -> None:
    write_jsonl(tmp_path / "x.jsonl", ["placeholder"])
    make(tmp_path)  # type: ignore[operator]
    inputs = [str(p) for p in sorted(tmp_path.iterdir()) if p.suffix in (".jsonl", ".parquet", ".csv")]
    key = ["--text-key", "body"] if "column" in message else []
    code = main(["--input", *inputs, "--tokenizer", corpus["tokenizer"], "--output", str(tmp_path / "out"), *key])  # type: ignore[list-item]
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_paths_tokenizers_and_other_settings_are_refused(
    corpus: dict[str, object], prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "vocab.txt").write_text("a\n")
    tok, inputs = corpus["tokenizer"], list(corpus["inputs"])  # type: ignore[call-overload]
    cases = [
        (["--input", str(tmp_path / "nope.jsonl"), "--tokenizer", tok], "nope.jsonl: no such file or directory"),
        (["--input", *inputs, "--tokenizer", str(tmp_path / "slow")], "no tokenizer.json, so no fast tokenizer"),
        (["--input", *inputs, "--tokenizer", str(tmp_path / "none")], "none: no such directory"),
        (["--input", *inputs, "--tokenizer", tok, "--seq-len", "16", "7", "--val-fraction", "0.5", "--chunk-docs", "9",
          "--shard-bytes", "1500"],
         "holds a prepared dataset with other settings (val_fraction differ); pass --overwrite"),
    ]  # fmt: skip
    for args, message in cases:
        output = prepared if "settings" in message else tmp_path / "out"
        assert main([*args, "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    # the refused run left the complete output untouched; --overwrite replaces it (elsewhere: a copy)
    PreparedDataset(prepared)
    copy = tmp_path / "copy"
    prepare(_config(corpus, copy))
    args = ["--input", *inputs, "--tokenizer", tok, "--seq-len", "16", "--val-fraction", "0.5", "--no-progress"]
    assert main([*args, "--output", str(copy), "--overwrite"]) == 0
    assert PreparedDataset(copy).manifest["settings"]["val_fraction"] == 0.5
    assert not (copy / "rows-L7-train.npy").exists()  # nothing of the replaced output is left


@pytest.mark.filterwarnings("ignore:'lightning_llmfast.prepare' found in sys.modules:RuntimeWarning")
def test_the_command_line_prints_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    argv = ["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", str(make_tokenizer(tmp_path / "tok")),
            "--output", str(tmp_path / "out")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["prepare", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("lightning_llmfast.prepare", run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'bad.jsonl'}:2: malformed JSON (Expecting value at column 10)\n"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 97, 1000, 4099])
def test_the_epoch_permutation_is_a_bijection_that_depends_on_its_key(size: int) -> None:
    positions = np.arange(size)
    first, second = permute(positions, size, key=1), permute(positions, size, key=2)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(size))
    assert permute(positions[::-1], size, key=1).tolist() == first[::-1].tolist()  # per position, order-free
    if size >= 16:
        assert first.tolist() != second.tolist() and first.tolist() != list(range(size))


def _cli_args(corpus: dict[str, object], output: Path) -> list[str]:
    """The command line of :func:`_config`'s settings."""
    return ["--input", *corpus["inputs"], "--tokenizer", corpus["tokenizer"], "--output", str(output),  # type: ignore[misc]
            "--seq-len", "16", "7", "--val-fraction", "0.2", "--chunk-docs", "9", "--shard-bytes", "1500",
            "--no-progress"]  # fmt: skip


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for name, data in file_bytes(source).items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    return target


def _unfinished(directory: Path) -> None:
    (directory / "manifest.json").unlink()
    (directory / ".partial").mkdir()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:-40]),
         r"manifest\.json cannot be read \(JSONDecodeError"),
        (lambda d: (d / "manifest.json").write_text(
            (d / "manifest.json").read_text().replace('"format_version": 2', '"format_version": 1')),
         "holds a prepared dataset of format version 1, not 2"),
        (lambda d: _unfinished(d) or (d / ".partial" / "settings.json").write_text('{"format_version": 2, '),
         r"settings\.json cannot be read"),
        (lambda d: _unfinished(d) or (d / ".partial" / "settings.json").write_text('{"format_version": 3}'),
         "holds an unfinished preparation of format version 3"),
        (lambda d: _unfinished(d), r"holds prepared files without manifest\.json or settings to read"),
    ],
)  # fmt: skip
def test_prepare_never_deletes_what_it_cannot_read(
    corpus: dict[str, object], prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: object,
    message: str,
) -> None:  # fmt: skip
    output = _copy(prepared, tmp_path / "out")
    damage(output)  # type: ignore[operator]
    before = file_bytes(output)
    assert main(_cli_args(corpus, output)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err
    assert "pass --overwrite to replace it" in err
    assert file_bytes(output) == before  # every byte in place
    assert main([*_cli_args(corpus, output), "--overwrite"]) == 0
    assert file_bytes(output) == file_bytes(prepared)


def test_a_version_1_output_is_refused_without_overwrite(corpus: dict[str, object], tmp_path: Path) -> None:
    output = _copy(Path(__file__).parent / "golden" / "prepared_v1", tmp_path / "v1")
    before = file_bytes(output)
    with pytest.raises(DataError, match="holds a prepared dataset of format version 1, not 2; pass --overwrite"):
        prepare(_config(corpus, output))
    assert file_bytes(output) == before


def test_every_file_is_flushed_to_disk_before_its_rename(
    corpus: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: set[str] = set()
    renamed: list[tuple[str, bool]] = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    def logged_replace(source: str | Path, target: str | Path) -> None:
        renamed.append((Path(target).name, str(Path(source).resolve()) in synced))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    manifest = prepare(_config(corpus, tmp_path / "out", workers=1))
    names = {name for name, _ in renamed}
    assert {"manifest.json", "settings.json", "chunk-00000.bin", "chunk-00000.json"} <= names
    assert set(manifest["files"]) <= names and all(was_synced for _, was_synced in renamed), renamed


def test_a_corrupt_chunk_record_or_chunk_file_is_named(
    corpus: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def stop(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("lightning_llmfast.data.prepare._assemble", stop)  # every chunk done, then interrupted
    output = tmp_path / "out"
    assert main(_cli_args(corpus, output)) == 130
    assert "interrupted; run the same command again" in capsys.readouterr().err
    monkeypatch.undo()
    record, chunk = output / ".partial" / "chunk-00002.json", output / ".partial" / "chunk-00004.bin"
    record.write_text('{"documents": 9, "tok')
    assert main(_cli_args(corpus, output)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {record}: corrupt chunk record (JSONDecodeError") and err.count("\n") == 1, err
    record.unlink()  # as the message says: the chunk is redone
    chunk.write_bytes(chunk.read_bytes()[:-2])
    assert main(_cli_args(corpus, output)) == 2
    assert capsys.readouterr().err.startswith(f"error: {chunk}: ")


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_gz_ends_in_one_error_line_naming_it(
    corpus: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in make_texts(400, seed=4))
    data = bytearray(gz.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    gz.write_bytes(bytes(data))
    argv = ["--input", str(gz), "--tokenizer", corpus["tokenizer"], "--output", str(tmp_path / "out")]  # type: ignore[list-item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: {re.escape(str(gz))}: unreadable after line \d+ \(\w+: .*\)\n", err), err


def test_an_unexpected_error_is_one_line_too(
    corpus: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(config: PrepareConfig) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr("lightning_llmfast.prepare.prepare", broken)
    assert main(_cli_args(corpus, tmp_path / "out")) == 1
    assert capsys.readouterr().err == "error: unexpected RuntimeError: a defect (please report it)\n"


def _tokens_by_hand(directory: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The manifest and documents of a prepared directory, read as docs/data.md shows."""
    manifest = json.loads((directory / "manifest.json").read_text())
    stream = np.concatenate([np.fromfile(directory / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]])
    offsets = np.load(directory / "documents.npy")
    return manifest, [stream[a:b] for a, b in itertools.pairwise(offsets)]


def _layout_bytes(directory: Path, seq_len: int, derived: bool = False) -> dict[str, bytes]:
    """The rows and pieces files of both splits: prepared (beside the data) or ``derived`` (in ``layout-L*/``)."""
    place = (lambda s: directory / f"layout-L{seq_len}-{s}") if derived else (lambda s: directory)
    return {n: (place(s) / n).read_bytes() for s in ("train", "val") for n in layout_files(seq_len, s)}


def test_any_seq_len_is_packed_from_the_index_on_first_use_and_cached(
    corpus: dict[str, object], prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only16 = tmp_path / "only16"
    prepare(_config(corpus, only16, seq_len=(16,)))
    tokens = {n: b for n, b in file_bytes(only16).items() if n.startswith("tokens-")}
    dataset = PreparedDataset(only16)
    for split in ("train", "val"):
        dataset.layout(7, split)
    # equal, byte for byte, to what prepare --seq-len 7 writes; the token files untouched; verify unaffected
    assert _layout_bytes(only16, 7, derived=True) == _layout_bytes(prepared, 7)
    assert {n: b for n, b in file_bytes(only16).items() if n.startswith("tokens-")} == tokens
    assert main(["--verify", str(only16)]) == 0
    assert sorted(p.name for p in only16.iterdir() if "L7" in p.name) == ["layout-L7-train", "layout-L7-val"]
    assert not [p for p in only16.rglob("*") if ".tmp-" in p.name or ".raw-" in p.name]
    # a later reader (another process, a DataLoader worker) checks the cache and packs nothing
    monkeypatch.setattr(layouts_module, "_PLACES", {})
    monkeypatch.setattr(layouts_module, "write_layout", None)
    assert PreparedDataset(only16).layout(7, "train").num_rows == dataset.layout(7, "train").num_rows


@pytest.mark.parametrize("seq_len", [2, 3, 97])
def test_a_derived_layout_holds_every_document_of_its_split_once(prepared: Path, tmp_path: Path, seq_len: int) -> None:
    copy = _copy(prepared, tmp_path / "copy")
    dataset = PreparedDataset(copy)
    _, documents = _tokens_by_hand(copy)
    val = in_validation(0, len(dataset), dataset.manifest["settings"]["val_fraction"])
    for split, members in (("train", ~val), ("val", val)):
        layout = dataset.layout(seq_len, split)
        seen: dict[int, list[tuple[int, int]]] = {}
        for r in range(layout.num_rows):
            row = layout.row(r)
            assert 0 < sum(n for _, _, n in row) <= seq_len
            for d, s, n in row:
                seen.setdefault(d, []).append((s, n))
        assert sorted(seen) == np.flatnonzero(members).tolist()
        for d, pieces in seen.items():  # whole chunks of seq_len from the start, then the remainder
            assert sorted(pieces) == [
                (s, min(seq_len, len(documents[d]) - s)) for s in range(0, len(documents[d]), seq_len)
            ]


def test_a_layout_is_packed_window_by_window(prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts_module, "PACK_WINDOW", 10)
    copy = _copy(prepared, tmp_path / "copy")
    dataset = PreparedDataset(copy)
    ids = np.flatnonzero(~in_validation(0, len(dataset), dataset.manifest["settings"]["val_fraction"]))
    layout = dataset.layout(11, "train")
    lengths = np.diff(np.load(copy / "documents.npy"))
    expected = []  # each window of 10 of the split's documents packed on its own, numbered back into the corpus
    for first in range(0, len(ids), 10):
        window = ids[first : first + 10]
        rows, pieces = pack_lengths(lengths[window], 11)
        expected += [[(int(window[d]), s, n) for d, s, n in pieces[a:b].tolist()] for a, b in itertools.pairwise(rows)]
    assert len(ids) > 30 and [layout.row(r) for r in range(layout.num_rows)] == expected


def test_a_version_1_directory_is_read_and_serves_any_length(tmp_path: Path) -> None:
    v1 = _copy(Path(__file__).parent / "golden" / "prepared_v1", tmp_path / "v1")
    manifest, documents = _tokens_by_hand(v1)
    assert manifest["version"] == 1 and len(manifest["shards"]) == 3  # a shard per chunk of 16 documents
    dataset = PreparedDataset(v1)
    assert len(dataset) == len(documents) == 40
    assert all(np.array_equal(dataset[i], doc) and doc[-1] == dataset.eos_id for i, doc in enumerate(documents))
    assert dataset.layout(16, "train").num_rows == manifest["layouts"]["16"]["train"]["rows"]
    batches = PreparedBatches([dataset], "train", seq_len=5, batch_size=4, shuffle_seed=0)
    segments = [b.num_tokens for b in batches]
    assert sum(segments) == manifest["splits"]["train"]["tokens"]
    assert main(["--verify", str(v1)]) == 0


def _mapped_shards(directory: Path) -> set[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if str(directory) in line and "tokens-" in line}


def test_files_grow_with_bytes_and_a_reader_keeps_a_few_shards_mapped(
    corpus: dict[str, object], tmp_path: Path
) -> None:
    one = prepare(_config(corpus, tmp_path / "one", shard_bytes=1 << 28))
    assert [s["file"] for s in one["shards"]] == ["tokens-00000.bin"]  # 131 documents, 15 chunks: one token file
    many = prepare(_config(corpus, tmp_path / "many", shard_bytes=1))  # a shard per chunk
    assert len(many["shards"]) == 15
    dataset = PreparedDataset(tmp_path / "many")
    order = np.random.default_rng(0).permutation(len(dataset))
    for i in order:
        assert int(dataset[int(i)][-1]) == dataset.eos_id
    assert len(_mapped_shards(tmp_path / "many")) <= 4
