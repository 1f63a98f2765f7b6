"""``python -m lightning_llmfast.tune``: :func:`lightning_llmfast.tune.main`."""

import sys

from lightning_llmfast.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
