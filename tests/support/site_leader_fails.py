"""One rank of a 2-rank site (gloo on 127.0.0.1, launched without torchrun, as srun or
mpirun would: nothing kills the other ranks when one fails). The leader's gossip hook raises
at step 3 and the leader catches it and stays alive for a while, as a user's loop that
handles errors would; the other rank must fail at once with the leader's error."""

from __future__ import annotations

import sys
import time

import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.runtime.site import SiteContext, SiteLeaderFailed, SiteOptimizer, init_site
from torch import nn

LEADER_STAYS = 60.0


def main() -> int:
    site = SiteContext.from_env()
    assert site is not None
    init_site(torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    cfg = build_config(
        {}, {"peer.id": "site-a", "metrics.enabled": False, "peer.listen": "127.0.0.1:0"}
    )
    opt = SiteOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, site)
    if site.leader:
        real = opt.gopt.after_local_step

        def failing() -> None:
            if opt.local_step == 3:
                raise RuntimeError("injected leader failure")
            real()

        opt.gopt.after_local_step = failing
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    for _ in range(10):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        try:
            opt.step()
        except SiteLeaderFailed as err:
            print(f"rank {site.rank}: SiteLeaderFailed: {err}", flush=True)
            return 3
        except RuntimeError as err:
            print(f"rank {site.rank}: caught {err}", flush=True)
            time.sleep(LEADER_STAYS)
            return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
