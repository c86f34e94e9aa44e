"""``shakespeare``: a small character-level transformer language model on Shakespeare's works.

Data layout: each work is cut into fixed blocks of ``BLOCK_CHARS`` characters (the short tail
of each work is dropped); every 20th block of every work is held out for validation, so the
validation set covers all works whatever the split. Training windows of ``context + 1``
characters are drawn inside one block, never across two.

Split between peers:
- ``iid``: the training blocks (contiguous 2 KiB passages) are shuffled (seeded) and split
  equally, so each peer holds passages from all over the corpus.
- ``dirichlet`` (non-IID): whole works are assigned to peers, balancing characters (largest
  work first); each peer sees only its own plays and poems. With more peers than works it
  falls back to the IID split (logged). ``alpha`` is not used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from gossipgrad.peer.tasks.base import (
    Batch,
    Task,
    TaskContext,
    index_batches,
    seeded_model,
    to_device,
)
from gossipgrad.peer.tasks.data import load_shakespeare
from gossipgrad.peer.tasks.sharding import balanced_groups, iid_partition
from torch import nn

logger = logging.getLogger(__name__)

VOCAB = 128
"""ASCII: the loader maps any other byte to ``?``."""
CONTEXT = 64
BLOCK_CHARS = 2048
VALID_EVERY = 20
EVAL_WINDOWS = 256
"""Default number of fixed validation windows in ``evaluate`` (~16k characters)."""
_EVAL_SEED = 1564


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (no mask buffer: ``is_causal`` in SDPA)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Decoder-only character LM: token + learned position embeddings, pre-LN blocks.

    No dropout, no weight tying and no buffers, so ``parameters()`` is the whole state.
    Defaults: 2 layers, d=128, 4 heads, context 64 (~430k parameters).
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        context: int = CONTEXT,
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T<=context) -> next-token logits (B, T, vocab)."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) of a ``(inputs, targets)`` batch."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _blocks(works: dict[str, bytes]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per work: its training blocks and validation blocks, each (k, BLOCK_CHARS) uint8."""
    train, valid = [], []
    for text in works.values():
        arr = np.frombuffer(text, dtype=np.uint8)
        k = len(arr) // BLOCK_CHARS
        blocks = arr[: k * BLOCK_CHARS].reshape(k, BLOCK_CHARS)
        held = np.arange(k) % VALID_EVERY == VALID_EVERY // 2
        train.append(blocks[~held])
        valid.append(blocks[held])
    return train, valid


def _window_batches(
    blocks: torch.Tensor, batch_size: int, context: int, seed: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Infinite (inputs, targets) batches of windows inside blocks (num_blocks, BLOCK_CHARS),
    from batch ``start`` on (the offsets of the ones before are drawn, not used)."""
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)  # offsets; rows use ``seed``
    span = blocks.shape[1] - context
    offsets = torch.arange(context + 1)
    for _ in range(start):
        torch.randint(0, span, (batch_size, 1), generator=gen)
    for rows in index_batches(len(blocks), batch_size, seed, start):
        starts = torch.randint(0, span, (batch_size, 1), generator=gen)
        windows = blocks[rows.unsqueeze(1), starts + offsets].long()
        yield windows[:, :-1], windows[:, 1:]


def shakespeare_task(ctx: TaskContext) -> Task:
    """Char-level transformer LM on 42 Shakespeare works (~5M characters); metric: val loss."""
    works = load_shakespeare(ctx.data_dir)
    train, valid = _blocks(works)
    shard = _train_shard(ctx, train)
    evaluate = _lm_evaluation(_eval_windows(ctx, valid))

    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)

    model = seeded_model(ctx, CharTransformer)
    seed = ctx.stream_seed(2)

    def batches(start: int = 0) -> Iterator[Batch]:
        for batch in _window_batches(shard, ctx.batch_size, CONTEXT, seed, start):
            yield to_device(batch, ctx.device)

    return Task(
        model=model,
        batches=batches,
        loss_fn=lm_loss,
        eval_fn=evaluate,
        metric="loss",
        higher_is_better=False,
        num_train_samples=int(shard.numel()),
        optimizer=make_optimizer,
        name="shakespeare",
    )


def _train_shard(ctx: TaskContext, train: list[np.ndarray]) -> torch.Tensor:
    """This peer's training blocks: whole works per peer, groups balanced by size, for
    ``dirichlet``; an IID split of all blocks otherwise."""
    if ctx.partition == "dirichlet" and ctx.num_peers <= len(train):
        groups = balanced_groups([len(b) for b in train], ctx.num_peers, ctx.seed)
        mine = np.concatenate([train[g] for g in groups[ctx.peer_index]])
    else:
        if ctx.partition == "dirichlet":
            logger.warning(
                "shakespeare: %s peers > %s works, falling back to the IID split",
                ctx.num_peers,
                len(train),
            )
        all_train = np.concatenate(train)
        mine = all_train[iid_partition(len(all_train), ctx.num_peers, ctx.seed)[ctx.peer_index]]
    return torch.from_numpy(np.ascontiguousarray(mine))


def _eval_windows(ctx: TaskContext, valid: list[np.ndarray]) -> torch.Tensor:
    """Fixed held-out windows (same on every peer): ``CONTEXT + 1`` characters each."""
    all_valid = torch.from_numpy(np.concatenate(valid))
    n_eval = ctx.eval_samples or EVAL_WINDOWS
    eval_gen = torch.Generator().manual_seed(_EVAL_SEED)
    rows = torch.randint(0, len(all_valid), (n_eval, 1), generator=eval_gen)
    starts = torch.randint(0, BLOCK_CHARS - CONTEXT, (n_eval, 1), generator=eval_gen)
    return all_valid[rows, starts + torch.arange(CONTEXT + 1)].long()


def _lm_evaluation(eval_windows: torch.Tensor) -> Callable[[nn.Module], dict[str, float]]:
    """Next-character loss, perplexity, bits per character and accuracy on the windows."""

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        total, correct = 0.0, 0
        for chunk in eval_windows.split(128):
            chunk = chunk.to(device)
            logits = model(chunk[:, :-1])
            target = chunk[:, 1:]
            total += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
                )
            )
            correct += int((logits.argmax(-1) == target).sum())
        count = eval_windows.shape[0] * CONTEXT
        loss = total / count
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_char": loss / math.log(2),
            "accuracy": correct / count,
        }

    return evaluate
