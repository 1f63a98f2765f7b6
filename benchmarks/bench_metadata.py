"""Micro-benchmark: packed-sequence metadata rebuilt in every layer ("per_layer") vs built once and cached.

One training step (forward + backward) of an L-layer attention stack over one packed row of T tokens:

- ``per_layer`` (before, as HF transformers' position-ids path): every layer derives ``cu_seqlens`` from
  ``position_ids`` on the device (a ``nonzero``), reads ``max_seqlen`` with ``.item()`` and builds its own metadata and
  attention plan (mask or gather indices);
- ``cached`` (after): the first layer builds one :class:`SequenceMetadata` from the batch's host-side
  ``cu_seqlens_cpu``; every layer reuses it and its memoised plan.

Both run the same attention kernel (``varlen_attention``, ``impl="auto"``), so the difference is the metadata work.
Variants are interleaved in one run; medians and ratios are printed as a Markdown table, with host syncs per step and
the share of the cached step spent building metadata.

Usage::

    python benchmarks/bench_metadata.py            # T in {2048, 4096, 8192}, L in {8, 32}
    python benchmarks/bench_metadata.py --quick    # small sizes, a few seconds
    python benchmarks/bench_metadata.py --attention  # the masked / per-document / bucketed measurement
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from torch import nn

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache, active_cache, varlen_attention

HIDDEN, HEADS, KV_HEADS = 128, 4, 2
HEAD_DIM = HIDDEN // HEADS


def per_layer_metadata(position_ids: torch.Tensor) -> SequenceMetadata:
    """The "before": boundaries derived on the device in every layer.

    Args:
        position_ids: ``(B, T)`` int64 positions restarting at 0 at each document.

    Returns:
        A fresh metadata (so its attention plan is rebuilt too).
    """
    flat = position_ids.reshape(-1)
    # NOTE: two host syncs per layer, deliberately: this is the behaviour the cache removes.
    starts = torch.nonzero(flat == 0).flatten()
    cu_seqlens = torch.cat([starts, starts.new_tensor([flat.numel()])])
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return SequenceMetadata.from_cu_seqlens(cu_seqlens, max_seqlen=max_seqlen)


class Layer(nn.Module):
    """Attention block ``x + proj(attn(qkv(x)))`` over ``(B, T, HIDDEN)``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        meta = per_layer_metadata(position_ids) if self.mode == "per_layer" else active_cache().get(x)
        n = x.shape[0] * x.shape[1]
        q, k, v = self.qkv(x).reshape(n, HEADS + 2 * KV_HEADS, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        return x + self.proj(varlen_attention(q, k, v, meta).reshape(x.shape))


class Stack(nn.Module):
    def __init__(self, n_layers: int, mode: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(mode) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, position_ids)
        return x


def make_batch(seq_len: int, seed: int) -> PackedBatch:
    """One packed row of ``seq_len`` tokens from documents of ``seq_len / 32`` to ``3 * seq_len / 32`` tokens (about
    16 per row)."""
    rng = random.Random(seed)
    low, high = max(1, seq_len // 32), max(1, 3 * seq_len // 32)
    docs = [[1] * rng.randint(low, high) for _ in range(seq_len // low + 1)]
    return next(pack_documents(docs, seq_len=seq_len, batch_size=1))


def _step(stack: Stack, x: torch.Tensor, batch: PackedBatch, cache: SequenceMetadataCache) -> None:
    with cache.batch(batch):
        stack(x, batch.position_ids).float().sum().backward()
    if x.is_cuda:
        torch.cuda.synchronize()  # a step is over when the device is done


def _build_metadata(batch: PackedBatch, x: torch.Tensor) -> None:
    # What the cached path does once per step: the metadata, and the attention mask or gather plan it needs, built
    # by the first attention call (one query head of one dimension: the structures, not the attention, dominate).
    meta = SequenceMetadata.from_batch(batch)
    q = x.new_zeros(x.shape[1], 1, HEAD_DIM)
    varlen_attention(q, q, q, meta)
    if x.is_cuda:
        torch.cuda.synchronize()


def run(quick: bool = False, repeats: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Runs the comparison and returns one row per ``(T, L)``.

    Args:
        quick: small sizes (T in {256, 512}, L in {2, 4}) for smoke tests.
        repeats: timed repeats per variant (default 3 quick, 5 full); the first (warm-up) round is not timed.
        device: ``"cpu"`` (fp32) or ``"cuda"`` (bf16: FlashAttention varlen in both variants).

    Returns:
        ``{"rows": [{"T", "L", "docs", "per_layer_ms", "cached_ms", "ratio", "per_layer_syncs", "cached_syncs",
        "metadata_ms", "metadata_share"}, ...]}``.

    Example::

        rows = run(quick=True)["rows"]
    """
    torch.manual_seed(0)
    seq_lens, depths = ((256, 512), (2, 4)) if quick else ((2048, 4096, 8192), (8, 32))
    repeats = repeats or (3 if quick else 5)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rows = []
    for seq_len in seq_lens:
        batch = make_batch(seq_len, seed=seq_len).to(device)
        for n_layers in depths:
            stacks = {mode: Stack(n_layers, mode).to(device, dtype) for mode in ("per_layer", "cached")}
            stacks["cached"].load_state_dict(stacks["per_layer"].state_dict())
            x = torch.randn(1, seq_len, HIDDEN, device=device, dtype=dtype, requires_grad=True)
            cache = SequenceMetadataCache()
            steps = {m: (lambda r, s=s, x=x, b=batch, c=cache: _step(s, x, b, c)) for m, s in stacks.items()}
            # the collator's host copy of the boundaries stays on the host on an accelerator too
            measured = interleave(steps, repeats, count=True, device=device, host=batch.cu_seqlens_cpu)
            syncs = {mode: m.syncs for mode, m in measured.items()}
            per_layer, cached = (measured[m].median for m in ("per_layer", "cached"))
            build = interleave({"metadata": lambda r, b=batch, x=x: _build_metadata(b, x)}, 5 * repeats, device=device)
            metadata = build["metadata"].median
            rows.append(
                {
                    "T": seq_len,
                    "L": n_layers,
                    "docs": SequenceMetadata.from_batch(batch).num_sequences,
                    "per_layer_ms": per_layer * 1e3,
                    "cached_ms": cached * 1e3,
                    "ratio": per_layer / cached,
                    "per_layer_syncs": syncs["per_layer"],
                    "cached_syncs": syncs["cached"],
                    "metadata_ms": metadata * 1e3,
                    "metadata_share": metadata / cached,
                }
            )
    return {"rows": rows, "threads": torch.get_num_threads(), "repeats": repeats, "device": device}


def attention_table(quick: bool = False, repeats: int = 5) -> list[dict[str, Any]]:
    """Times the three exact CPU attention paths (forward + backward), interleaved, relative to ``bucketed``.

    Args:
        quick: fewer sizes.
        repeats: timed repeats per path (after one warm-up).

    Returns:
        One dict per ``(N, docs)``: ``{"N", "docs", "masked", "per_document", "bucketed_ms"}`` (ratios to bucketed).

    Example::

        for row in attention_table(quick=True): print(row)
    """
    sizes = (128, 512) if quick else (128, 256, 512, 1024, 2048)
    out = []
    for n in sizes:
        for docs in (1, 2, 4, 16, 64, 256):
            if docs > n:
                continue
            rng = random.Random(n * 1000 + docs)
            cuts = sorted(rng.sample(range(1, n), docs - 1))
            meta = SequenceMetadata.from_cu_seqlens([0, *cuts, n])
            q = torch.randn(n, HEADS, HEAD_DIM, requires_grad=True)
            k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, requires_grad=True) for _ in range(2))
            paths = {
                impl: (
                    lambda r, impl=impl, q=q, k=k, v=v, m=meta: varlen_attention(q, k, v, m, impl=impl).sum().backward()
                )
                for impl in ("masked", "per_document", "bucketed")
            }
            med = {impl: m.median for impl, m in interleave(paths, repeats).items()}
            out.append(
                {
                    "N": n,
                    "docs": docs,
                    "masked": med["masked"] / med["bucketed"],
                    "per_document": med["per_document"] / med["bucketed"],
                    "bucketed_ms": med["bucketed"] * 1e3,
                }
            )
    return out


def to_markdown(result: dict[str, Any]) -> str:
    """Formats :func:`run`'s result as a Markdown table."""
    lines = [
        f"Step = forward + backward of an L-layer attention stack (hidden {HIDDEN}, {HEADS} heads, {KV_HEADS} kv "
        f"heads), one packed row of T tokens, on {result['device']}; median of {result['repeats']} interleaved "
        f"repeats, {result['threads']} CPU threads.",
        "",
        "| T | L | docs | per_layer ms | cached ms | per_layer / cached | syncs/step per_layer | syncs/step cached "
        "| metadata ms/step (cached) | metadata share of cached step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['T']} | {r['L']} | {r['docs']} | {r['per_layer_ms']:.1f} | {r['cached_ms']:.1f} | "
            f"{r['ratio']:.3f} | {r['per_layer_syncs']} | {r['cached_syncs']} | {r['metadata_ms']:.3f} | "
            f"{100 * r['metadata_share']:.2f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--attention", action="store_true", help="compare the CPU attention paths instead")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1 keeps timings stable on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention:
        print("| N | docs | masked / bucketed | per_document / bucketed | bucketed ms |")
        print("|---|---|---|---|---|")
        for r in attention_table(args.quick, args.repeats or 5):
            print(f"| {r['N']} | {r['docs']} | {r['masked']:.2f} | {r['per_document']:.2f} | {r['bucketed_ms']:.2f} |")
        return
    print(to_markdown(run(args.quick, args.repeats, args.device)))


if __name__ == "__main__":
    main()
