"""Packed data: the byte tokenizer, corpora, the streaming packer and ``PackedBatch`` (plain PyTorch, no Lightning).

Example::

    from lightning_llmfast.data import TextCorpus, pack_documents

    corpus = TextCorpus()  # the running Python's standard library sources, byte-level
    for batch in pack_documents(corpus, seq_len=256, batch_size=8, vocab_size=corpus.vocab_size):
        logits = model(batch.input_ids, position_ids=batch.position_ids)
"""

from __future__ import annotations

from lightning_llmfast.data.batch import PackedBatch
from lightning_llmfast.data.corpus import BOS_ID, EOS_ID, VOCAB_SIZE, SyntheticCorpus, TextCorpus, decode, encode
from lightning_llmfast.data.dataset import EpochPlan, PackedDocumentDataset
from lightning_llmfast.data.packing import DEFAULT_LOOKAHEAD, IGNORE_INDEX, check_packing_args, pack_documents
from lightning_llmfast.data.prepared import PreparedBatches, PreparedDataset

__all__ = [
    "BOS_ID",
    "DEFAULT_LOOKAHEAD",
    "EOS_ID",
    "EpochPlan",
    "IGNORE_INDEX",
    "VOCAB_SIZE",
    "PackedBatch",
    "PackedDocumentDataset",
    "PreparedBatches",
    "PreparedDataset",
    "SyntheticCorpus",
    "TextCorpus",
    "check_packing_args",
    "decode",
    "encode",
    "pack_documents",
]
