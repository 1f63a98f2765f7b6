"""``prepare``: tokens equal the tokenizer's ids + EOS, bytes independent of workers, resumable after kill -9,
complete-or-refused outputs, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import re
import runpy
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from _prepared import file_bytes, make_texts, make_tokenizer, write_jsonl, write_parquet
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_llmfast import DataError
from lightning_llmfast.data import PreparedDataset
from lightning_llmfast.data.prepare import PrepareConfig, prepare
from lightning_llmfast.data.prepared import permute
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
            "val_fraction": 0.2, "chunk_docs": 9, "progress": False, **kwargs}  # fmt: skip
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
    assert len(manifest["shards"]) == -(-131 // 9)  # a shard per chunk of 9 documents
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
    monkeypatch.setattr("lightning_llmfast.data.prepare.CHUNK_CHARS", 500)
    prepare(_config(corpus, tmp_path / "out", chunk_docs=1000))
    dataset = PreparedDataset(tmp_path / "out")
    expected, chars, count = [], 0, 0
    for text in corpus["texts"]:  # type: ignore[attr-defined]
        chars, count = chars + len(text), count + 1
        if chars >= 500:
            expected.append(count)
            chars, count = 0, 0
    expected += [count] if count else []
    assert [shard["documents"] for shard in dataset.manifest["shards"]] == expected and len(expected) > 10
    assert dataset.manifest["settings"]["chunk_chars"] == 500
    assert [d.tolist() for d in dataset] == corpus["reference"]


def test_kill_9_mid_run_then_the_same_command_ends_with_the_same_bytes(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "big.jsonl", make_texts(6000, seed=5, max_words=30))
    args = ["--input", str(tmp_path / "big.jsonl"), "--tokenizer", str(tokenizer), "--seq-len", "32",
            "--val-fraction", "0.1", "--chunk-docs", "2", "--workers", "2", "--no-progress"]  # fmt: skip
    killed = tmp_path / "killed"
    # the command in a forked process (no second interpreter start-up), with its own two worker processes
    proc = multiprocessing.get_context("fork").Process(target=main, args=([*args, "--output", str(killed)],))
    proc.start()
    partial, deadline = killed / ".partial", time.monotonic() + 120
    while len(list(partial.glob("chunk-*.json"))) < 20 and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    done = len(list(partial.glob("chunk-*.json")))
    assert proc.exitcode == -signal.SIGKILL and 20 <= done < 3000, (proc.exitcode, done)
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
        (["--input", *inputs, "--tokenizer", tok, "--seq-len", "16", "7", "--val-fraction", "0.5", "--chunk-docs", "9"],
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
