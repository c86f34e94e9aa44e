"""Built-in tasks, sharding, user tasks, the centralized baseline, and missing-data errors."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.flat import FloatBuffers
from gossipgrad.peer.membership import metropolis_hastings_weights, topology_from_name
from gossipgrad.peer.tasks import (
    BUILTIN_TASKS,
    DataUnavailableError,
    Task,
    TaskContext,
    build_task,
    train_centralized,
)
from gossipgrad.peer.tasks.charlm import BLOCK_CHARS, VALID_EVERY
from gossipgrad.peer.tasks.data import (
    FASHION_MNIST_FILES,
    load_digits,
    load_fashion_mnist,
    load_shakespeare,
    parse_idx,
    read_idx,
)
from gossipgrad.peer.tasks.sharding import balanced_groups, dirichlet_partition, iid_partition
from gossipgrad.peer.tasks.training import task_context
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support import ROOT

FETCH_SCRIPT = ROOT / "scripts" / "fetch_data.sh"


def _available(load) -> bool:
    try:
        load()
    except DataUnavailableError:
        return False
    return True


needs_fmnist = pytest.mark.skipif(
    not _available(lambda: load_fashion_mnist("test")),
    reason="Fashion-MNIST absent (scripts/fetch_data.sh installs dataset-fashion-mnist)",
)
needs_shakespeare = pytest.mark.skipif(
    not _available(load_shakespeare),
    reason="Shakespeare texts absent (scripts/fetch_data.sh caches them)",
)


def _ctx(**kw) -> TaskContext:
    base = {"peer_index": 0, "num_peers": 4, "seed": 0, "batch_size": 16}
    base.update(kw)
    return TaskContext(**base)


def _sgd_steps(task: Task, steps: int) -> None:
    opt = task.make_optimizer()
    it = task.batches()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(task.model, next(it)).backward()
        opt.step()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --- context and names ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_context_validation() -> None:
    with pytest.raises(ValueError, match="peer_index"):
        TaskContext(peer_index=4, num_peers=4)
    with pytest.raises(ValueError, match="partition"):
        TaskContext(partition="skewed")
    with pytest.raises(ValueError, match="alpha"):
        TaskContext(partition="dirichlet", alpha=0)
    assert TaskContext(partition="non-iid").partition == "dirichlet"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["mnist", "digits:", ":factory", "a:b:c", "no_such_mod_xyz:f"])
def test_bad_task_names_list_the_choices(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        build_task(bad, _ctx())
    msg = str(err.value)
    assert all(name in msg for name in BUILTIN_TASKS)
    assert "module:factory" in msg


# --- sharding -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(
    num_items=st.integers(min_value=1, max_value=2000),
    num_peers=st.integers(min_value=1, max_value=33),
    seed=st.integers(min_value=0, max_value=10**6),
)
def test_iid_partition_is_disjoint_equal_and_covers(num_items: int, num_peers: int, seed: int):
    shards = iid_partition(num_items, num_peers, seed)
    assert len(shards) == num_peers
    joined = np.concatenate(shards)
    assert np.array_equal(np.sort(joined), np.arange(num_items))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    again = iid_partition(num_items, num_peers, seed)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(
    labels=hnp.arrays(np.int64, st.integers(40, 1500), elements=st.integers(0, 9)),
    num_peers=st.integers(min_value=1, max_value=20),
    alpha=st.floats(min_value=0.01, max_value=100.0),
    seed=st.integers(min_value=0, max_value=10**6),
)
def test_dirichlet_partition_is_disjoint_covers_and_nonempty(
    labels: np.ndarray, num_peers: int, alpha: float, seed: int
) -> None:
    shards = dirichlet_partition(labels, num_peers, alpha, seed)
    joined = np.concatenate(shards)
    assert np.array_equal(np.sort(joined), np.arange(len(labels)))
    min_size = min(max(1, len(labels) // (10 * num_peers)), len(labels) // num_peers)
    assert min(len(s) for s in shards) >= min_size
    again = dirichlet_partition(labels, num_peers, alpha, seed)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def _label_skew(labels: np.ndarray, shards: list[np.ndarray]) -> float:
    """Mean total-variation distance between each shard's label histogram and the global one."""
    k = labels.max() + 1
    glob = np.bincount(labels, minlength=k) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[s], minlength=k) / len(s) - glob).sum() for s in shards]
    return float(np.mean(tv))


@pytest.mark.timeout(30)
def test_dirichlet_is_skewed_and_iid_is_not() -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=6000)
    iid = iid_partition(len(labels), 8, seed=0)
    skew_01 = _label_skew(labels, dirichlet_partition(labels, 8, 0.1, seed=0))
    skew_1 = _label_skew(labels, dirichlet_partition(labels, 8, 1.0, seed=0))
    skew_100 = _label_skew(labels, dirichlet_partition(labels, 8, 100.0, seed=0))
    assert _label_skew(labels, iid) < 0.08
    assert skew_01 > 0.5
    assert skew_01 > skew_1 > skew_100
    assert skew_100 < 0.1
    # Very skewed draws leave peers (nearly) empty: shards are topped up to 10% of fair share.
    tiny = dirichlet_partition(labels[:1000], 20, 0.01, seed=0)
    assert min(len(s) for s in tiny) >= 5
    assert np.array_equal(np.sort(np.concatenate(tiny)), np.arange(1000))


@pytest.mark.timeout(30)
def test_balanced_groups_cover_every_group_once() -> None:
    sizes = [5, 9, 1, 7, 3, 3, 8, 2]
    groups = balanced_groups(sizes, 3, seed=1)
    assert sorted(g for grp in groups for g in grp) == list(range(len(sizes)))
    loads = [sum(sizes[g] for g in grp) for grp in groups]
    assert max(loads) - min(loads) <= max(sizes)
    with pytest.raises(ValueError):
        balanced_groups([1, 2], 3, seed=0)


# --- digits ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_digits_are_sklearns_arrays_read_without_importing_sklearn() -> None:
    from sklearn.datasets import load_digits as sklearn_load_digits

    x, y = load_digits()
    bunch = sklearn_load_digits()
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, bunch.data.astype(np.float32))
    assert np.array_equal(y, bunch.target)
    # A peer process pays ~2 s of CPU for importing scikit-learn; the digits task must not.
    probe = (
        "import sys\n"
        "from gossipgrad.peer.tasks import TaskContext, build_task\n"
        "build_task('digits', TaskContext(num_peers=2, seed=0))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_digits_shards_cover_training_set(partition: str) -> None:
    tasks = [build_task("digits", _ctx(peer_index=i, partition=partition)) for i in range(4)]
    assert sum(t.num_train_samples for t in tasks) == 1797 - 360
    x, y = next(tasks[0].batches())
    assert x.shape == (16, 64) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    # Same seed -> same initial model on every peer; other seed -> other model.
    assert all(torch.equal(_flat(t.model), _flat(tasks[0].model)) for t in tasks)
    other = build_task("digits", _ctx(seed=1))
    assert not torch.equal(_flat(other.model), _flat(tasks[0].model))
    # Peers draw different batches; the same peer rebuilt draws the same ones.
    again = build_task("digits", _ctx(peer_index=0, partition=partition))
    assert torch.equal(next(again.batches())[0], x)
    assert not torch.equal(next(tasks[1].batches())[0], x)


@pytest.mark.timeout(60)
def test_digits_sgd_steps_reduce_loss_and_build_leaves_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    task = build_task("digits", _ctx(batch_size=64))
    assert torch.equal(torch.rand(3), before)
    assert task.metric == "accuracy" and task.higher_is_better
    start = task.evaluate(task.model)
    assert task.evaluate(task.model) == start
    _sgd_steps(task, 60)
    end = task.evaluate(task.model)
    assert end["loss"] < 0.5 * start["loss"]
    assert end["accuracy"] > start["accuracy"] + 0.3
    assert task.model.training


def _gossip_swarm(name: str, n: int, steps: int, partition: str) -> list[float]:
    """In-process decentralized SGD (D-PSGD, Lian et al. 2017) over a ring with MH weights."""
    tasks = [
        build_task(name, _ctx(peer_index=i, num_peers=n, partition=partition, batch_size=32))
        for i in range(n)
    ]
    ring = topology_from_name("ring")
    weights = [metropolis_hastings_weights(i, lambda k: ring.neighbors(k, n)) for i in range(n)]
    opts = [t.make_optimizer() for t in tasks]
    its = [t.batches() for t in tasks]
    for _ in range(steps):
        for task, opt, it in zip(tasks, opts, its, strict=True):
            opt.zero_grad(set_to_none=True)
            task.loss(task.model, next(it)).backward()
            opt.step()
        with torch.no_grad():
            snap = [[p.clone() for p in t.model.parameters()] for t in tasks]
            for i, task in enumerate(tasks):
                for k, p in enumerate(task.model.parameters()):
                    p.copy_(sum(w * snap[j][k] for j, w in weights[i].items()))
    return [t.evaluate(t.model)["accuracy"] for t in tasks]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_four_peer_digits_swarm_matches_centralized(partition: str) -> None:
    steps = 150
    swarm = _gossip_swarm("digits", 4, steps, partition)
    central = train_centralized("digits", steps, _ctx(num_peers=4, batch_size=32))
    assert central["accuracy"] > 0.93
    assert min(swarm) > central["accuracy"] - (0.03 if partition == "iid" else 0.08)


@pytest.mark.timeout(60)
def test_train_centralized_learns_and_zero_steps_is_chance() -> None:
    ctx = _ctx(num_peers=2, batch_size=32)
    untrained = train_centralized("digits", 0, ctx)
    trained = train_centralized("digits", 100, ctx)
    assert untrained["accuracy"] < 0.3
    assert trained["accuracy"] > 0.9
    assert train_centralized("digits", 100, ctx) == trained
    frozen = train_centralized(
        "digits", 100, ctx, optimizer=lambda params: torch.optim.SGD(params, lr=0.0)
    )
    assert frozen == untrained


# --- user tasks -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("support_on_path")
def test_user_task_module_factory() -> None:
    tasks = [build_task("support.tiny_user_task:make_task", _ctx(peer_index=i)) for i in range(4)]
    assert sum(t.num_train_samples for t in tasks) == 400
    assert all(torch.equal(_flat(t.model), _flat(tasks[0].model)) for t in tasks)
    task = tasks[0]
    x, y = next(task.batches())
    assert x.shape == (16, 8) and y.shape == (16,)
    start = task.evaluate(task.model)
    _sgd_steps(task, 80)
    assert task.evaluate(task.model)["accuracy"] > max(0.85, start["accuracy"])
    skewed = [
        build_task(
            "support.tiny_user_task:make_task", _ctx(peer_index=i, partition="dirichlet", alpha=0.1)
        )
        for i in range(4)
    ]
    assert sum(t.num_train_samples for t in skewed) == 400
    with pytest.raises(ValueError, match="no training samples"):
        build_task("support.tiny_user_task:make_task", _ctx(peer_index=499, num_peers=500))


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("support_on_path")
def test_user_task_map_style_dataset_and_errors() -> None:
    # Dirichlet labels come from the dataset's .targets; shards still cover the data.
    skewed = [
        build_task(
            "support.tiny_user_task:make_dataset_task", _ctx(peer_index=i, partition="dirichlet")
        )
        for i in range(4)
    ]
    assert sum(t.num_train_samples for t in skewed) == 300
    task = build_task("support.tiny_user_task:make_dataset_task", _ctx())
    assert task.metric == "loss" and not task.higher_is_better
    x, y = next(task.batches())
    assert x.shape == (16, 8) and y.dtype == torch.int64
    before = task.evaluate(task.model)["loss"]
    _sgd_steps(task, 50)
    assert task.evaluate(task.model)["loss"] < before
    with pytest.raises(TypeError, match="not a Task"):
        build_task("support.tiny_user_task:not_a_task", _ctx())
    with pytest.raises(ValueError, match="no attribute"):
        build_task("support.tiny_user_task:missing", _ctx())


# --- data files -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None)
@given(
    arr=hnp.arrays(
        st.sampled_from([np.uint8, np.int8, np.dtype(">i2"), np.dtype(">i4"), np.dtype(">f4")]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
    )
)
def test_idx_round_trip(arr: np.ndarray) -> None:
    code = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D}[arr.dtype.str[1:]]
    big = arr.astype(arr.dtype.newbyteorder(">"))
    raw = bytes([0, 0, code, arr.ndim]) + np.array(arr.shape, ">u4").tobytes() + big.tobytes()
    out = parse_idx(raw)
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable
    with pytest.raises(ValueError):
        parse_idx(raw[:-1] if arr.size else raw + b"\0")
    with pytest.raises(ValueError, match="magic"):
        parse_idx(b"\1" + raw[1:])


@pytest.mark.timeout(30)
def test_missing_data_gives_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GOSSIPGRAD_FASHION_MNIST", str(tmp_path / "nowhere"))
    monkeypatch.setenv("GOSSIPGRAD_DATA", str(tmp_path / "empty"))
    for name in ("fashion-mnist-mlp", "fashion-mnist-cnn", "shakespeare"):
        with pytest.raises(DataUnavailableError) as err:
            build_task(name, _ctx())
        msg = str(err.value)
        assert "\n" not in msg
        assert "scripts/fetch_data.sh" in msg
    with pytest.raises(FileNotFoundError):  # DataUnavailableError is a FileNotFoundError
        build_task("shakespeare", _ctx())


@pytest.mark.timeout(30)
def test_fashion_loader_reads_idx_gz_from_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A hand-written IDX set in $GOSSIPGRAD_FASHION_MNIST is found and parsed."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("test", 12)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        img_name, lab_name = FASHION_MNIST_FILES[split]
        header = bytes([0, 0, 8, 3]) + np.array(images.shape, ">u4").tobytes()
        (tmp_path / img_name).write_bytes(gzip.compress(header + images.tobytes()))
        header = bytes([0, 0, 8, 1]) + np.array([n], ">u4").tobytes()
        (tmp_path / lab_name).write_bytes(gzip.compress(header + labels.tobytes()))
    monkeypatch.setenv("GOSSIPGRAD_FASHION_MNIST", str(tmp_path))
    np.testing.assert_array_equal(read_idx(tmp_path / "t10k-labels-idx1-ubyte.gz"), labels)
    task = build_task("fashion-mnist-cnn", _ctx(num_peers=2, batch_size=8))
    assert task.num_train_samples == 20
    x, y = next(task.batches())
    assert x.shape == (8, 1, 28, 28) and y.shape == (8,)
    assert set(task.evaluate(task.model)) == {"accuracy", "loss"}


# --- Fashion-MNIST and Shakespeare (real data; skipped where absent) -------------------------


def _no_buffers(model: torch.nn.Module) -> bool:
    return not list(model.buffers())


@needs_fmnist
@pytest.mark.timeout(120)
def test_fashion_mnist_tasks_build_shard_and_learn() -> None:
    for name, lo, hi in (
        ("fashion-mnist-mlp", 600_000, 700_000),
        ("fashion-mnist-cnn", 80_000, 120_000),
        ("fashion-mnist-cnn-bn", 80_000, 120_000),
    ):
        tasks = [build_task(name, _ctx(peer_index=i, num_peers=3, batch_size=32)) for i in range(3)]
        assert sum(t.num_train_samples for t in tasks) == 60_000
        task = tasks[0]
        n_params = sum(p.numel() for p in task.model.parameters())
        assert lo <= n_params <= hi, n_params
        # Only the BatchNorm CNN has buffers: 2 x (16 + 32) running statistics, 2 counters.
        if name.endswith("-bn"):
            assert FloatBuffers(task.model).numel == 96
        else:
            assert _no_buffers(task.model)
        x, y = next(task.batches())
        assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32
        assert y.shape == (32,) and int(y.max()) < 10
        assert abs(float(x.mean())) < 1.0
        start = task.evaluate(task.model)
        assert start["accuracy"] < 0.25
        _sgd_steps(task, 40)
        end = task.evaluate(task.model)
        assert end["accuracy"] > 0.55, (name, end)
    skewed = [
        build_task("fashion-mnist-mlp", _ctx(peer_index=i, num_peers=5, partition="dirichlet"))
        for i in range(5)
    ]
    assert sum(t.num_train_samples for t in skewed) == 60_000


@needs_shakespeare
@pytest.mark.timeout(120)
def test_shakespeare_task_shapes_splits_and_learning() -> None:
    iid = [build_task("shakespeare", _ctx(peer_index=i, num_peers=4)) for i in range(4)]
    by_work = [
        build_task("shakespeare", _ctx(peer_index=i, num_peers=4, partition="dirichlet"))
        for i in range(4)
    ]
    total = sum(t.num_train_samples for t in iid)
    assert total == sum(t.num_train_samples for t in by_work)
    assert total > 4_000_000
    assert max(t.num_train_samples for t in by_work) < 0.4 * total
    task = iid[0]
    assert task.metric == "loss" and not task.higher_is_better
    assert _no_buffers(task.model)
    assert 300_000 < sum(p.numel() for p in task.model.parameters()) < 600_000
    x, y = next(task.batches())
    assert x.shape == y.shape == (16, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 128
    start = task.evaluate(task.model)
    assert task.evaluate(task.model) == start
    assert set(start) >= {"loss", "perplexity", "accuracy"}
    _sgd_steps(task, 30)
    end = task.evaluate(task.model)
    assert end["loss"] < start["loss"] - 1.0
    assert end["perplexity"] < start["perplexity"]


@pytest.mark.timeout(60)
def test_fetch_data_is_quiet_when_done_and_reports_what_is_missing(tmp_path: Path) -> None:
    """scripts/fetch_data.sh (real process, no network): silent when every data set is there."""
    fmnist = tmp_path / "fmnist"
    fmnist.mkdir()
    for img, lab in FASHION_MNIST_FILES.values():
        (fmnist / img).write_bytes(b"x")
        (fmnist / lab).write_bytes(b"x")
    shk = tmp_path / "data" / "shakespeare"
    shk.mkdir(parents=True)
    (shk / ".complete").touch()
    env = {**os.environ, "GOSSIPGRAD_DATA": str(tmp_path / "data")}

    def run(fm_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(FETCH_SCRIPT), *args],
            env={**env, "GOSSIPGRAD_FASHION_MNIST": str(fm_dir)},
            capture_output=True,
            text=True,
            timeout=30,
        )

    done = run(fmnist)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    missing = run(tmp_path / "nowhere")
    assert missing.returncode == 0 and missing.stdout == ""
    assert "fashion-mnist" in missing.stderr and "unavailable" in missing.stderr
    assert run(tmp_path / "nowhere", "--strict").returncode == 1


def _works_of_windows(task: Task, works: dict[str, bytes], batches: int = 2) -> list[set[str]]:
    """For each training window of ``task``: the works that contain it (substring search)."""
    out = []
    it = task.batches()
    for _ in range(batches):
        x, _y = next(it)
        for row in x:
            window = bytes(row.to(torch.uint8).tolist())
            hits = {name for name, text in works.items() if window in text}
            assert hits, "a training window is not in any work"
            out.append(hits)
    return out


@needs_shakespeare
@pytest.mark.timeout(120)
def test_shakespeare_non_iid_split_is_by_work() -> None:
    works = load_shakespeare()
    names = list(works)
    # Training blocks per work, as the task counts them (every 20th block is validation).
    blocks = [len(text) // BLOCK_CHARS for text in works.values()]
    sizes = [k - sum(1 for i in range(k) if i % VALID_EVERY == VALID_EVERY // 2) for k in blocks]
    groups = balanced_groups(sizes, 4, seed=0)
    for peer in range(4):
        ctx = _ctx(peer_index=peer, partition="dirichlet", batch_size=32)
        task = build_task("shakespeare", ctx)
        assert task.num_train_samples == BLOCK_CHARS * sum(sizes[g] for g in groups[peer])
        mine = {names[g] for g in groups[peer]}
        for hits in _works_of_windows(task, works):
            assert hits & mine, (peer, hits)
    iid_task = build_task("shakespeare", _ctx(peer_index=0, batch_size=32))
    # IID: passages from all over the corpus.
    assert len({min(hits) for hits in _works_of_windows(iid_task, works)}) >= 15


@pytest.mark.timeout(60)
def test_task_listing_cli(tmp_path: Path) -> None:
    """python -m gossipgrad.peer.tasks: one line per task, exit 1 when one is unavailable."""
    env = {**os.environ, "GOSSIPGRAD_DATA": str(tmp_path)}
    cmd = [sys.executable, "-m", "gossipgrad.peer.tasks"]
    good = subprocess.run([*cmd, "digits"], capture_output=True, text=True, env=env, timeout=50)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("digits") and "1,437 training samples" in good.stdout
    bad = subprocess.run(
        [*cmd, "digits", "shakespeare"], capture_output=True, text=True, env=env, timeout=50
    )
    assert bad.returncode == 1
    assert "shakespeare" in bad.stdout and "fetch_data.sh" in bad.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("eval_samples", "expected"), [(0, 360), (7, 7)])
def test_train_eval_samples_sets_how_many_held_out_samples_an_evaluation_reads(
    eval_samples: int, expected: int
) -> None:
    """``train.eval_samples`` reaches the task: the model sees exactly that many held-out
    inputs per evaluation; 0 keeps the task's default (all 360 of digits' test images)."""
    cfg = TrainSection(task="digits", eval_samples=eval_samples)
    task = build_task(cfg.task, task_context(cfg, 0, 1))
    seen: list[int] = []
    handle = task.model.register_forward_hook(lambda _m, args, _out: seen.append(len(args[0])))
    try:
        task.evaluate(task.model)
    finally:
        handle.remove()
    assert sum(seen) == expected
