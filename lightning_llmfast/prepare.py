"""``python -m lightning_llmfast.prepare``: turn local text corpora into a prepared dataset, or verify one.

Prepare::

    python -m lightning_llmfast.prepare --input corpus/ extra.jsonl.gz --tokenizer tok/ --output prepared/ \\
        --workers 4 --seq-len 2048 --val-fraction 0.01

Verify (recompute every checksum)::

    python -m lightning_llmfast.prepare --verify prepared/

A bad input ends the run with one line ``error: ...`` and exit status 2 (1 for an unexpected error, 130 when
interrupted), never a traceback. An output that cannot be read, or of another format version, is refused and left as
it is unless ``--overwrite`` is given. Running the same command
again after an interruption (even ``kill -9``) continues from the finished chunks. See
:mod:`lightning_llmfast.data.prepare` for the pipeline and ``docs/data.md`` for the format.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_llmfast.data.prepare import SHARD_BYTES, PrepareConfig, prepare, verify
from lightning_llmfast.errors import LLMFastError

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's argument parser.

    Example::

        args = parser().parse_args(["--input", "a.jsonl", "--tokenizer", "tok", "--output", "out"])
    """
    p = argparse.ArgumentParser(
        prog="python -m lightning_llmfast.prepare",
        description="Tokenize local corpora into memory-mapped token shards with a document index, pre-packed rows "
        "and a manifest; or --verify a prepared directory.",
    )
    p.add_argument("--input", nargs="+", metavar="PATH", help=".jsonl, .jsonl.gz, .parquet, .txt files, directories "
                   "of them, or HF datasets directories (save_to_disk)")  # fmt: skip
    p.add_argument("--tokenizer", metavar="DIR", help="local transformers tokenizer directory (fast: tokenizer.json)")
    p.add_argument("--output", metavar="DIR", help="directory to write")
    p.add_argument("--text-key", default="text", help="jsonl field / parquet or arrow column of the text")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (the output does not depend on it)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048], metavar="N", help="row lengths to pre-pack")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents in the validation split")
    p.add_argument("--lines", action="store_true", help="a document per non-empty line of .txt files")
    p.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS to every document")
    p.add_argument("--overwrite", action="store_true", help="replace an output prepared with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verify", metavar="DIR", help="recheck the size and sha256 of every file of DIR, then exit")
    p.add_argument("--chunk-docs", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--shard-bytes", type=int, default=SHARD_BYTES, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (0, or 2, 1 or 130 after printing ``error: ...``).

    Example::

        main(["--verify", "prepared/"])
    """
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.verify is not None:
            manifest = verify(args.verify)
            print(f"{args.verify}: all {len(manifest['files'])} files match their sha256")
            return 0
        missing = [f"--{name}" for name in ("input", "tokenizer", "output") if getattr(args, name) is None]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)} (or --verify DIR)")
        config = PrepareConfig(
            inputs=tuple(args.input), tokenizer=args.tokenizer, output=args.output, text_key=args.text_key,
            workers=args.workers, seq_len=tuple(args.seq_len), val_fraction=args.val_fraction, lines=args.lines,
            bos=args.bos, overwrite=args.overwrite, chunk_docs=args.chunk_docs, shard_bytes=args.shard_bytes,
            progress=not args.no_progress,
        )  # fmt: skip
        manifest = prepare(config)
    except (LLMFastError, OSError) as err:  # OSError: an unwritable output, a full disk
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to continue from the finished chunks", file=sys.stderr)
        return 130
    except Exception as err:  # a defect of ours: still one line, and the way to report it
        print(f"error: unexpected {type(err).__name__}: {err} (please report it)", file=sys.stderr)
        return 1
    rows = ", ".join(
        f"seq_len {n}: {layout['train']['rows']} train / {layout['val']['rows']} val rows"
        for n, layout in manifest["layouts"].items()
    )
    print(
        f"{args.output}: {manifest['num_documents']} documents, {manifest['num_tokens']} tokens ({manifest['dtype']}) "
        f"in {len(manifest['shards'])} shard(s); {rows}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
