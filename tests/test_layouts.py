"""Layouts derived at load time (a prepared dataset served at a new ``seq_len``): checked in full before use and
derived again with a warning when damaged, published under temporary names no other host or process takes, derived
window by window in memory bounded by the window, and derived once per process on a read-only dataset, its
``DataLoader`` workers opening what the main process derived."""

from __future__ import annotations

import errno
import itertools
import json
import os
import pickle
import socket
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from lightning_llmfast.data import PreparedBatches, PreparedDataset
from lightning_llmfast.data import layouts as layouts_module
from lightning_llmfast.data.files import atomic_file, sha256_file
from lightning_llmfast.data.layouts import check_layout, in_validation, layout_files, split_windows
from lightning_llmfast.data.packing import pack_lengths
from lightning_llmfast.data.prepared import FORMAT, FORMAT_VERSION

SEQ_LEN = 13


def _synthetic(root: Path, lengths: np.ndarray, *, tokens: bool = True, val_fraction: float = 0.2) -> Path:
    """A prepared directory written by hand (random token ids, no tokenizer): ``lengths`` documents."""
    root.mkdir()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(root / "documents.npy", offsets)
    names, shards = ["documents.npy"], []
    if tokens:
        ids = np.random.default_rng(len(lengths)).integers(1, 300, int(offsets[-1]), dtype=np.uint16)
        ids.tofile(root / "tokens-00000.bin")
        names.append("tokens-00000.bin")
        shards.append({"file": "tokens-00000.bin", "first_document": 0, "documents": len(lengths), "first_token": 0,
                       "tokens": int(offsets[-1])})  # fmt: skip
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "dtype": "uint16", "num_documents": len(lengths),
        "num_tokens": int(offsets[-1]), "splits": {}, "shards": shards, "layouts": {},
        "tokenizer": {"name": "synthetic", "sha256": "0" * 64, "vocab_size": 300, "eos_id": 0, "bos_id": None,
                      "pad_id": None},
        "files": {n: {"bytes": (root / n).stat().st_size, "sha256": sha256_file(root / n)} for n in names},
        "settings": {"val_fraction": val_fraction},
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def _lengths(count: int, seed: int) -> np.ndarray:
    """Awkward document lengths: mostly short, some of several rows, a few exactly ``SEQ_LEN``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * SEQ_LEN, count)
    lengths[rng.integers(0, count, count // 20)] = rng.integers(3 * SEQ_LEN, 9 * SEQ_LEN, count // 20)
    lengths[:: count // 7] = SEQ_LEN
    return lengths


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process would: no layout found or derived yet."""
    monkeypatch.setattr(layouts_module, "_PLACES", {})


def _files(directory: Path, split: str = "train") -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in layout_files(SEQ_LEN, split)}


def _reference(lengths: np.ndarray, val_fraction: float, split: str, window: int) -> list[list[tuple[int, int, int]]]:
    """The rows of ``split``, packed window by window from a list of its documents built one by one."""
    ids = [d for d in range(len(lengths)) if bool(in_validation(d, 1, val_fraction)[0]) == (split == "val")]
    rows = []
    for first in range(0, len(ids), window):
        window_ids = ids[first : first + window]
        offsets, pieces = pack_lengths(lengths[window_ids], SEQ_LEN)
        for a, b in itertools.pairwise(offsets):
            rows.append([(window_ids[d], int(s), int(n)) for d, s, n in pieces[a:b]])
    return rows


def _damage(directory: Path, damage: str) -> None:
    rows_path, pieces_path = (directory / n for n in layout_files(SEQ_LEN, "train"))
    rows, pieces = np.load(rows_path), np.load(pieces_path)
    if damage == "truncated":
        rows_path.write_bytes(rows_path.read_bytes()[:-8])
    elif damage == "not increasing":
        rows[5], rows[6] = rows[6], rows[5]
        np.save(rows_path, rows)
    elif damage == "a piece missing":
        row = int(np.flatnonzero(np.diff(rows) >= 2)[3])  # a row of several pieces: it keeps one, no row is empty
        np.save(pieces_path, np.delete(pieces, rows[row], axis=0))
        np.save(rows_path, rows - (rows > rows[row]))
    elif damage == "a piece twice":
        pieces[1] = pieces[0]
        np.save(pieces_path, pieces)
    elif damage == "pieces gone":
        pieces_path.unlink()


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncated", "unreadable (ValueError"),
        ("not increasing", "row offsets that do not increase"),
        ("a piece missing", "one of theirs is missing"),
        ("a piece twice", "is missing and another is counted twice"),
        ("pieces gone", "unreadable (FileNotFoundError"),
    ],
)
def test_a_damaged_cached_layout_is_derived_again_with_a_warning_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, problem: str
) -> None:
    monkeypatch.setattr(layouts_module, "PACK_WINDOW", 300)  # several windows
    lengths = _lengths(1301, seed=3)
    root = _synthetic(tmp_path / "data", lengths)
    layout = PreparedDataset(root).layout(SEQ_LEN, "train")
    reference = _reference(lengths, 0.2, "train", 300)
    assert [layout.row(r) for r in range(layout.num_rows)] == reference
    del layout  # its maps: the damage below rewrites the files in place
    directory = root / f"layout-L{SEQ_LEN}-train"
    good = _files(directory)
    monkeypatch.setattr(layouts_module, "_PLACES", {})  # another process: it checks the published pair, in full
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole pair passes the check: no warning, nothing derived
        PreparedDataset(root).layout(SEQ_LEN, "train")
    _damage(directory, damage)
    monkeypatch.setattr(layouts_module, "_PLACES", {})
    with pytest.warns(UserWarning, match=f"{directory}: .*; deriving it again") as caught:
        again = PreparedDataset(root).layout(SEQ_LEN, "train")
    assert _files(directory) == good
    assert len(caught) == 1 and problem in str(caught[0].message)
    assert [again.row(r) for r in range(again.num_rows)] == reference
    assert sorted(p.name for p in root.iterdir() if p.name.startswith((".", "layout"))) == ["layout-L13-train"]


def test_the_check_names_what_is_wrong_and_passes_every_valid_layout() -> None:
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 40, 500)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.arange(0, len(lengths), 2)  # every other document (a split), in windows of 50
    windows = [ids[i : i + 50] for i in range(0, len(ids), 50)]
    rows, pieces = [np.zeros(1, dtype=np.int64)], []
    for window in windows:
        r, p = pack_lengths(lengths[window], SEQ_LEN)
        p[:, 0] = window[p[:, 0]]
        rows.append(r[1:] + sum(len(x) for x in pieces))
        pieces.append(p)
    rows_all, pieces_all = np.concatenate(rows), np.concatenate(pieces)
    assert check_layout(rows_all, pieces_all, windows, offsets, SEQ_LEN) is None
    empty = np.zeros(1, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)  # a split without documents
    assert check_layout(*empty, [], offsets, SEQ_LEN) is None
    assert "fewer than" in check_layout(*empty, windows[:1], offsets, SEQ_LEN)
    longer = pieces_all.copy()
    longer[np.argmax(longer[:, 2] < SEQ_LEN), 2] += 1
    assert "is not a piece of its document" in check_layout(rows_all, longer, windows, offsets, SEQ_LEN)
    foreign = pieces_all.copy()
    foreign[0, 0] += 1  # an odd document: not in the split
    assert "one of theirs is missing, or it is out of place" in check_layout(
        rows_all, foreign, windows, offsets, SEQ_LEN
    )
    merged = np.delete(rows_all, 1)  # two rows made one: too long, or at least no longer a window's end
    assert check_layout(merged, pieces_all, windows, offsets, SEQ_LEN) is not None
    assert "fewer than" in check_layout(rows_all[:-1], pieces_all[: rows_all[-2]], windows, offsets, SEQ_LEN)


def test_temporary_names_carry_the_host_the_pid_and_a_random_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, pid = socket.gethostname(), str(os.getpid())
    names = []
    for target in ("a", "a"):
        with atomic_file(tmp_path / target) as f:
            f.write(b"x")
            names += [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(names) == 2 and names[0] != names[1] and all(host in n and pid in n for n in names)
    written = []
    real = layouts_module.write_layout

    def spy(directory: Path, *args: object) -> dict[str, int]:
        written.append(directory.name)
        return real(directory, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(layouts_module, "write_layout", spy)
    PreparedDataset(_synthetic(tmp_path / "data", _lengths(100, seed=1))).layout(SEQ_LEN, "val")
    assert len(written) == 1 and written[0].startswith(f".layout-L{SEQ_LEN}-val.tmp-{host}-{pid}-")
    # a second writer finding a whole layout published meanwhile (not the damaged one it saw) leaves it standing
    published = tmp_path / "data" / f"layout-L{SEQ_LEN}-val"
    before = published.stat().st_ino, _files(published, "val")
    offsets = np.load(tmp_path / "data" / "documents.npy")
    windows = split_windows(100, 0.2, "val")
    assert layouts_module.publish_layout(tmp_path / "data", SEQ_LEN, "val", windows, offsets) == published
    assert (published.stat().st_ino, _files(published, "val")) == before and len(written) == 2
    assert not [p for p in (tmp_path / "data").iterdir() if ".tmp-" in p.name]


def _read_only(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Nothing can be created in ``root`` (as on a read-only mount; root ignores file modes, so this says it)."""
    real = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if Path(path).parent == root:
            raise PermissionError(errno.EROFS, "read-only file system", str(path))
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)


def test_a_read_only_dataset_is_packed_once_per_process_and_its_workers_open_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = _lengths(400, seed=5)
    root = _synthetic(tmp_path / "data", lengths)
    writable = _synthetic(tmp_path / "writable", lengths)
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    _read_only(monkeypatch, root)
    counter = tmp_path / "derivations"
    real = layouts_module.write_layout

    def counted(*args: object) -> dict[str, int]:
        with open(counter, "a") as f:  # a file: the count of every process, forked workers included
            f.write(f"{os.getpid()}\n")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layouts_module, "write_layout", counted)
    batches = PreparedBatches([PreparedDataset(root)], "train", seq_len=SEQ_LEN, batch_size=3, shuffle_seed=1)
    loader = DataLoader(batches, batch_size=None, num_workers=2, multiprocessing_context="fork")
    epochs = []
    for epoch in range(2):  # workers are started anew every epoch (persistent_workers=False)
        batches.set_position(epoch, 0)
        epochs.append([b.input_ids.tolist() for b in loader])
    assert counter.read_text().split() == [str(os.getpid())]
    assert epochs[0] != epochs[1] and {p.name: p.read_bytes() for p in root.iterdir()} == before
    # what it derived is byte for byte what a writable copy publishes, kept in this process's temporary directory
    derived = PreparedDataset(root).layout(SEQ_LEN, "train")
    published = PreparedDataset(writable).layout(SEQ_LEN, "train")
    assert np.array_equal(derived.rows, published.rows) and np.array_equal(derived.pieces, published.pieces)
    scratch = Path(derived.rows.filename).parents[2]
    assert scratch.parent == Path(tempfile.gettempdir()) and f"{socket.gethostname()}-{os.getpid()}-" in scratch.name
    # a worker started by spawn finds nothing in its fresh module: the pickled dataset says where the layout lies
    dataset = batches.sources[0]
    monkeypatch.setattr(layouts_module, "_PLACES", {})
    monkeypatch.setattr(layouts_module, "write_layout", None)
    clone = pickle.loads(pickle.dumps(dataset))
    assert np.array_equal(clone.layout(SEQ_LEN, "train").pieces, derived.pieces)


def test_deriving_and_checking_a_layout_hold_a_window_of_documents_not_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count, window = 600_000, 1 << 10
    root = _synthetic(tmp_path / "data", np.random.default_rng(0).integers(1, 2 * SEQ_LEN, count), tokens=False)
    monkeypatch.setattr(layouts_module, "PACK_WINDOW", window)
    longest = []
    real = layouts_module.pack_lengths

    def pack(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        longest.append(len(lengths))
        return real(lengths, seq_len)

    monkeypatch.setattr(layouts_module, "pack_lengths", pack)
    one_int_per_document = 8 * count  # what a derivation holding the split's document numbers needs at least
    peaks = []
    for _ in range(2):  # derive (this process), then check the published pair (as another process)
        dataset = PreparedDataset(root)
        tracemalloc.start()
        layout = dataset.layout(SEQ_LEN, "train")
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        monkeypatch.setattr(layouts_module, "_PLACES", {})
    train = sum(len(w) for w in split_windows(count, 0.2, "train"))
    assert max(longest) == window and sum(longest) == train and len(longest) == -(-train // window)  # derived once
    assert layout.pieces[:, 2].sum() == np.load(root / "documents.npy")[-1] - _val_tokens(root, count)
    assert max(peaks) < one_int_per_document / 4, peaks


def _val_tokens(root: Path, count: int) -> int:
    offsets = np.load(root / "documents.npy")
    val = in_validation(0, count, 0.2)
    return int((offsets[1:] - offsets[:-1])[val].sum())
