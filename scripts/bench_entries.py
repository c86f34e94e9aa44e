"""The issue-6 benchmark grid: which experiment specs and overrides ``bench_suite.py`` runs.

Each entry is one experiment spec from scripts/experiments/ plus ``--set`` overrides. Entries
that run no baselines of their own are compared with the baselines of their group's reference
entry: same task, seed, shards, peer count and sample budget, and the baselines are
deterministic, so re-running them per ablation would only cost CPU time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    """One experiment: a spec, overrides, and the entry whose baselines it is compared with."""

    name: str
    spec: str
    sets: tuple[str, ...] = ()
    reference: str | None = None  # None: runs its own baselines
    quick: bool = False
    tags: tuple[str, ...] = field(default=())


def _no_baselines(*sets: str) -> tuple[str, ...]:
    return (*sets, "baselines.run=[]")


DIGITS = "bench_digits.toml"
FMNIST = "bench_fmnist_mlp.toml"
WAN = "bench_digits_wan.toml"
CNN8 = "bench_fmnist_cnn8.toml"

ENTRIES: list[Entry] = [
    # digits, IID, 4 peers: reference with DDP and PowerSGD, then ablations of one knob each
    Entry("digits", DIGITS, quick=True, tags=("ablation", "codec")),
    Entry(
        "digits-gamma0.03", DIGITS, _no_baselines("gossip.gamma=0.03"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.05", DIGITS, _no_baselines("gossip.gamma=0.05"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.2", DIGITS, _no_baselines("gossip.gamma=0.2"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.5", DIGITS, _no_baselines("gossip.gamma=0.5"), "digits", tags=("ablation",)
    ),
    Entry("digits-h2", DIGITS, _no_baselines("gossip.local_steps=2"), "digits", tags=("ablation",)),
    Entry("digits-h4", DIGITS, _no_baselines("gossip.local_steps=4"), "digits", tags=("ablation",)),
    # error feedback off: CHOCO's x - xhat memory replaced by difference compression (DCD)
    Entry(
        "digits-ef-off",
        DIGITS,
        _no_baselines("gossip.error_feedback=false"),
        "digits",
        tags=("ablation",),
    ),
    Entry(
        "digits-exact-topk",
        DIGITS,
        _no_baselines('gossip.codec="topk:0.01:exact+int8"'),
        "digits",
        tags=("ablation",),
    ),
    Entry(
        "digits-topk0.001",
        DIGITS,
        _no_baselines('gossip.codec="topk:0.001+int8"'),
        "digits",
        tags=("codec",),
    ),
    Entry(
        "digits-int4",
        DIGITS,
        _no_baselines('gossip.codec="int4"', "gossip.gamma=0.5"),
        "digits",
        tags=("codec",),
    ),
    Entry(
        "digits-sign",
        DIGITS,
        _no_baselines('gossip.codec="sign"', "gossip.gamma=0.1"),
        "digits",
        tags=("codec",),
    ),
    # non-IID: the baselines must train the same Dirichlet shards, so they run again
    Entry(
        "digits-dirichlet0.5",
        DIGITS,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        quick=True,
        tags=("noniid",),
    ),
    # scaling: 8 peers (DDP's ring all-reduce bytes per rank grow with 2(n-1)/n)
    Entry("digits-8", DIGITS, ("experiment.peers=8",), quick=True, tags=("scaling",)),
    # Fashion-MNIST MLP, IID, 4 peers
    Entry("fmnist", FMNIST, tags=("codec",)),
    Entry(
        "fmnist-int4",
        FMNIST,
        _no_baselines('gossip.codec="int4"', "gossip.gamma=0.5"),
        "fmnist",
        tags=("codec",),
    ),
    Entry(
        "fmnist-topk0.001",
        FMNIST,
        _no_baselines('gossip.codec="topk:0.001+int8"'),
        "fmnist",
        tags=("codec",),
    ),
    Entry(
        "fmnist-gamma0.03",
        FMNIST,
        _no_baselines("gossip.gamma=0.03"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-gamma0.2",
        FMNIST,
        _no_baselines("gossip.gamma=0.2"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-exponential",
        FMNIST,
        _no_baselines('gossip.topology="exponential"'),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-ef-off",
        FMNIST,
        _no_baselines("gossip.error_feedback=false"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-dirichlet0.5",
        FMNIST,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        tags=("noniid",),
    ),
    Entry(
        "fmnist-dirichlet0.5-final100",
        FMNIST,
        _no_baselines('train.partition="dirichlet"', "train.alpha=0.5", "gossip.final_rounds=100"),
        "fmnist-dirichlet0.5",
        tags=("noniid",),
    ),
    Entry(
        "fmnist-final100",
        FMNIST,
        _no_baselines("gossip.final_rounds=100"),
        "fmnist",
        tags=("codec",),
    ),
    # 8 peers: the Fashion-MNIST CNN (codecs, topology, local steps, non-IID) and the char-LM
    Entry("cnn8", CNN8, tags=("cnn8",)),
    *(
        Entry(f"cnn8-{name}", CNN8, _no_baselines(*sets), "cnn8", tags=("cnn8",))
        for name, sets in (
            ("exponential", ('gossip.topology="exponential"',)),
            ("h2", ("gossip.local_steps=2",)),
            ("final100", ("gossip.final_rounds=100",)),
            ("topk0.001", ('gossip.codec="topk:0.001+int8"',)),
            ("int4", ('gossip.codec="int4"', "gossip.gamma=0.5")),
            ("sign", ('gossip.codec="sign"',)),
        )
    ),
    Entry(
        "cnn8-dirichlet0.5",
        CNN8,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        tags=("cnn8",),
    ),
    Entry("charlm8", "bench_shakespeare8.toml", tags=("charlm8",)),
    # diagnosis: the same swarm gossiping dense models (no compression, plain D-PSGD mixing)
    Entry(
        "charlm8-dense",
        "bench_shakespeare8.toml",
        _no_baselines('gossip.codec="none"', "gossip.gamma=1.0"),
        "charlm8",
        tags=("charlm8",),
    ),
    # scaling: 16 peers (16 processes per phase on the 2-core host)
    Entry("digits-16", DIGITS, ("experiment.peers=16",), tags=("scaling",)),
    # emulated WAN (netns; root and iproute2)
    Entry("digits-wan", WAN, tags=("wan",)),
    Entry("fmnist-wan", "bench_fmnist_wan.toml", tags=("wan",)),
    Entry("fmnist-wan8", "bench_fmnist_wan.toml", ("experiment.peers=8",), tags=("wan",)),
    # a race to DDP's final accuracy: the swarm may take twice DDP's steps (time_to_target)
    Entry(
        "fmnist-wan-race",
        "bench_fmnist_wan.toml",
        ("train.steps=300", "baselines.steps=150"),
        tags=("wan",),
    ),
    Entry(
        "fmnist-wan8-race",
        "bench_fmnist_wan.toml",
        ("experiment.peers=8", "train.steps=300", "baselines.steps=150"),
        tags=("wan",),
    ),
]


def _reseeded(seed: int) -> list[Entry]:
    """The digits ablation entries again with another seed (data, init and sampling)."""
    out = []
    for e in ENTRIES:
        if e.spec == DIGITS and "ablation" in e.tags:
            ref = f"{e.reference}-s{seed}" if e.reference else None
            tags = (*(t for t in e.tags if t != "ablation"), "seeds")
            sets = (*e.sets, f"experiment.seed={seed}")
            out.append(Entry(f"{e.name}-s{seed}", e.spec, sets, ref, tags=tags))
    return out


ENTRIES += _reseeded(1) + _reseeded(2)
# Fashion-MNIST headline rows again with seeds 1 and 2 (IID; Dirichlet with and without
# final rounds), each seed with its own baselines.
for _seed in (1, 2):
    _dirichlet = ('train.partition="dirichlet"', "train.alpha=0.5", f"experiment.seed={_seed}")
    ENTRIES += [
        Entry(f"fmnist-s{_seed}", FMNIST, (f"experiment.seed={_seed}",), tags=("fmnist-seeds",)),
        Entry(f"fmnist-dirichlet0.5-s{_seed}", FMNIST, _dirichlet, tags=("fmnist-seeds",)),
        Entry(
            f"fmnist-dirichlet0.5-final100-s{_seed}",
            FMNIST,
            _no_baselines(*_dirichlet, "gossip.final_rounds=100"),
            f"fmnist-dirichlet0.5-s{_seed}",
            tags=("fmnist-seeds",),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    """List the grid: one line per entry (name, spec, overrides)."""
    import argparse

    parser = argparse.ArgumentParser(
        description="The benchmark grid scripts/bench_suite.py runs: prints each entry's name, "
        "spec and --set overrides (run entries with bench_suite.py)."
    )
    parser.parse_args(argv)
    for e in ENTRIES:
        print(f"{e.name:40s} {e.spec:28s} {' '.join(e.sets)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
