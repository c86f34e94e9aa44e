"""A task none of the algorithms' defaults were tuned on: a char-level GPT with tied embeddings.

Issue 42's check of per-algorithm defaults: a user who brings a task of their own and sets
only ``gossip.algorithm = "diloco"`` should land where the tuned spec lands on its own task.
This is such a task, loaded as a user task (``train.task =
"gossipgrad.experiment.bench.chargpt:chargpt_task"``), so it goes through the same path as
any user's. It differs from the built-in ``shakespeare`` task in what the defaults could have
been fitted to:

- the model: the output layer is the token embedding transposed (tied, no output bias, as in
  GPT-2), 3 pre-LN blocks of width 64, context 96;
- the data: the same Shakespeare corpus read as one text, its last tenth held out for
  validation, the first nine tenths cut into one contiguous stretch per peer (not shuffled
  passages), windows drawn anywhere in a peer's stretch.

Deterministic: the model from ``ctx.seed``, a peer's windows from its stream seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from gossipgrad.peer.tasks.base import Batch, Task, TaskContext, seeded_model, to_device
from gossipgrad.peer.tasks.charlm import VOCAB, Block
from gossipgrad.peer.tasks.data import load_shakespeare
from torch import nn

CONTEXT = 96
D_MODEL = 64
N_LAYERS = 3
N_HEADS = 4
HELD_OUT = 0.1
"""Share of the text, at its end, kept for validation."""
EVAL_WINDOWS = 256
_EVAL_SEED = 4242


class TiedCharGPT(nn.Module):
    """Decoder-only char LM whose output projection is its token embedding (weight tying)."""

    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, n_layers: int = N_LAYERS,
                 n_heads: int = N_HEADS, context: int = CONTEXT) -> None:  # fmt: skip
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T<=context) -> next-token logits (B, T, vocab)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok.weight)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _text(ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
    """This peer's contiguous training stretch and the held-out tail, as uint8 tensors."""
    works = load_shakespeare(ctx.data_dir)
    text = np.frombuffer(b"".join(works[k] for k in sorted(works)), dtype=np.uint8)
    cut = int(len(text) * (1 - HELD_OUT))
    per_peer = cut // ctx.num_peers
    start = ctx.peer_index * per_peer
    mine = torch.from_numpy(text[start : start + per_peer].copy())
    return mine, torch.from_numpy(text[cut:].copy())


def _evaluation(valid: torch.Tensor) -> Callable[[nn.Module], dict[str, float]]:
    gen = torch.Generator().manual_seed(_EVAL_SEED)
    starts = torch.randint(0, len(valid) - CONTEXT - 1, (EVAL_WINDOWS, 1), generator=gen)
    windows = valid[starts + torch.arange(CONTEXT + 1)].long()

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        total = 0.0
        for chunk in windows.split(128):
            chunk = chunk.to(device)
            logits = model(chunk[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1),
                                           reduction="sum"))  # fmt: skip
        loss = total / (EVAL_WINDOWS * CONTEXT)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    return evaluate


def chargpt_task(ctx: TaskContext) -> Task:
    """The tied-embedding char GPT on this peer's stretch of Shakespeare; metric: val loss."""
    mine, valid = _text(ctx)
    seed = ctx.stream_seed(2)

    def batches(start: int = 0) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed)
        offsets = torch.arange(CONTEXT + 1)
        for _ in range(start):
            torch.randint(0, len(mine) - CONTEXT - 1, (ctx.batch_size, 1), generator=gen)
        while True:
            starts = torch.randint(0, len(mine) - CONTEXT - 1, (ctx.batch_size, 1), generator=gen)
            windows = mine[starts + offsets].long()
            yield to_device((windows[:, :-1], windows[:, 1:]), ctx.device)

    return Task(
        model=seeded_model(ctx, TiedCharGPT),
        batches=batches,
        loss_fn=_loss,
        eval_fn=_evaluation(valid),
        metric="loss",
        higher_is_better=False,
        num_train_samples=int(mine.numel()),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
        name="chargpt",
    )
