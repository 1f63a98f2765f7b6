"""``python -m lightning_llmfast.export CHECKPOINT OUT_DIR``: a trained checkpoint back to a transformers directory.

CHECKPOINT is what the strategy writes for an ``HFCausalLMModule`` built from a pretrained directory, or for a
``MoEGPTLightningModule`` (written as the Mixtral it is: :mod:`lightning_llmfast.parallel.moegpt_export`): a Lightning
``.ckpt`` file or a DCP directory (FSDP2, expert parallelism, pipeline stages, any world size). OUT_DIR, created
atomically, is what ``AutoModelForCausalLM.from_pretrained`` loads (:mod:`lightning_llmfast.parallel.export`).
Errors print one line, ``error: ...``, and exit with status 2.

Example::

    python -m lightning_llmfast.export ckpts/last.ckpt exported/ --dtype bf16 --max-shard-size 5GB
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_llmfast.errors import LLMFastError
from lightning_llmfast.parallel.export import DTYPES, export_checkpoint

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the export; returns the exit status (0, or 2 after printing ``error: ...``).

    Example::

        main(["ckpts/last.ckpt", "exported/", "--dtype", "bf16"])
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_llmfast.export",
        description="Export an HFCausalLMModule or MoEGPTLightningModule checkpoint (.ckpt file or DCP directory) as "
        "a transformers directory.",
    )
    parser.add_argument("checkpoint", help="a Lightning .ckpt file or a DCP checkpoint directory")
    parser.add_argument("out_dir", help="the directory to create (must not exist)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype (default: the source checkpoint's; bf16 for a block-FP8 source)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            max_shard_size=args.max_shard_size,
        )
    except (LLMFastError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
