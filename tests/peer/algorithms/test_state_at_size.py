"""The pieces that keep a peer's gossip state small at model size: the initial model in a
file, averages kept as messages, a consensus step in slices, float16 copies kept exact."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch
from gossipgrad.compression import from_spec, native
from gossipgrad.compression.difference import subtract_into
from gossipgrad.peer import flat
from gossipgrad.peer.algorithms import mixing
from gossipgrad.peer.algorithms.averaging import Average
from gossipgrad.peer.algorithms.edges import Copies, Edge, Incoming, Kind, Verdict
from gossipgrad.peer.algorithms.mixing import Pair, consensus_step
from gossipgrad.peer.flat import SpilledTensor, tensor_checksum
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("numel", [0, 1, 1000, 3 * (1 << 20) + 5])
def test_a_copy_with_its_checksum_is_the_copy_and_the_checksum(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``copy_with_checksum`` (exact-diloco's θ = a and the anchor's checksum in one pass, a
    slice at a time) leaves the copy and returns ``tensor_checksum`` of the source, across
    slices and for a strided source (one after the other)."""
    monkeypatch.setattr(flat, "_CHECKSUM_SLICE", 1 << 19)
    src = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    dst = torch.full_like(src, float("nan"))
    assert flat.copy_with_checksum(dst, src) == tensor_checksum(src)
    assert torch.equal(dst, src)
    strided = torch.randn(2, numel)[:, 0] if numel else src
    other = torch.empty_like(strided)
    assert flat.copy_with_checksum(other, strided) == tensor_checksum(strided)
    assert torch.equal(other, strided)


def test_a_spilled_tensor_reads_back_bit_for_bit_from_many_threads() -> None:
    t = torch.randn(300_001, generator=torch.Generator().manual_seed(0))
    spilled = SpilledTensor(t)
    outs = [torch.empty_like(t) for _ in range(4)]
    threads = [threading.Thread(target=spilled.copy_to, args=(o,)) for o in outs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert all(torch.equal(o, t) for o in outs)
    assert torch.equal(spilled.load(), t)
    half = spilled.copy_to(torch.empty(t.shape, dtype=torch.float16))
    assert torch.equal(half, t.half())  # rounded as a copy_ would
    with pytest.raises(ValueError, match="spilled tensor"):
        spilled.copy_to(torch.empty(7))
    spilled.close()


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid 0 0
/dev/vdb /tmp/on\\040disk ext4 rw 0 0
tmpfs /run tmpfs rw 0 0
"""


def test_the_filesystem_of_a_path_is_its_longest_mount_point() -> None:
    assert flat.filesystem_type("/tmp", MOUNTS) == "tmpfs"
    assert flat.filesystem_type("/tmp/x/y", MOUNTS) == "tmpfs"
    assert flat.filesystem_type("/tmp/on disk/x", MOUNTS) == "ext4"  # \\040: a space
    assert flat.filesystem_type("/tmpx", MOUNTS) == "ext4"  # not inside /tmp
    assert flat.filesystem_type("/var/tmp", MOUNTS) == "ext4"
    assert flat.filesystem_type("/var/tmp", "") == ""


def _in_memory(path: str) -> bool:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return flat.filesystem_type(path, f.read()) == "tmpfs"


@pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or not _in_memory("/dev/shm") or _in_memory(flat.DISK_TMP),
    reason="needs a tmpfs at /dev/shm and a disk at /var/tmp",
)
def test_a_tensor_is_not_spilled_into_memory_when_the_temporary_folder_is_a_tmpfs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With TMPDIR on a tmpfs the spilled model would cost the RAM it is spilled to save:
    its file goes to the disk's temporary folder instead (and stays where TMPDIR says when
    that is a disk)."""
    for folder, expected in [("/dev/shm", flat.DISK_TMP), (flat.DISK_TMP, flat.DISK_TMP)]:
        monkeypatch.setenv("TMPDIR", folder)
        monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
        flat.spill_directory.cache_clear()
        spilled = SpilledTensor(torch.ones(10))
        try:
            where = os.readlink(f"/proc/self/fd/{spilled._fd}")
            assert os.path.dirname(where) == expected, where
        finally:
            spilled.close()
    flat.spill_directory.cache_clear()


def test_an_average_of_messages_adds_what_the_dense_sum_would() -> None:
    gen = torch.Generator().manual_seed(1)
    codec = from_spec("topk:0.3+int8")
    vectors = [torch.randn(5000, generator=gen) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    payloads = [codec.encode(v, seed=i + 1) for i, v in enumerate(vectors)]
    dense = torch.zeros(5000)
    for p, w in zip(payloads, weights, strict=True):
        dense.add_(codec.decode(p), alpha=w)
    average = Average(codec, tuple(zip(payloads, weights, strict=True)))
    out = average.add_to_(torch.ones(5000), alpha=-2.0)
    torch.testing.assert_close(out, 1.0 - 2.0 * dense)


@settings(max_examples=30, deadline=None)
@given(
    numel=st.integers(1, 40),
    pairs=st.integers(0, 3),
    gamma=st.floats(0.05, 1.0),
    clip=st.sampled_from([0.0, 0.5, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_the_consensus_step_in_slices_is_the_step_in_one(
    numel: int, pairs: int, gamma: float, clip: float, seed: int
) -> None:
    """Slices of 7 elements (any length over and under a slice): x moves by
    γ Σ w (mirror − public), each pull clipped to ``clip``, and the distance returned is
    the norm of that weighted pull, ||Σ w (mirror − public)||, before γ; a tensor given as
    ``also_into`` ends equal to the new x (also where no pair moved it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    ps = [
        Pair(
            torch.randn(numel, generator=gen, dtype=torch.float64),
            torch.randn(numel, generator=gen, dtype=torch.float64),
            float(torch.rand(1, generator=gen)),
        )
        for _ in range(pairs)
    ]
    expected, toward = x.clone(), torch.zeros_like(x)
    for p in ps:
        pull = p.mirror - p.public
        if clip > 0 and float(pull.norm()) > clip:
            pull = pull * (clip / float(pull.norm()))
        expected += gamma * p.weight * pull
        toward += p.weight * pull
    old = mixing.CHUNK
    mixing.CHUNK = 7
    also = torch.full_like(x, float("nan"))
    try:
        distance = consensus_step(x, ps, gamma, clip, also_into=also)
    finally:
        mixing.CHUNK = old
    torch.testing.assert_close(x, expected)
    assert torch.equal(also, x)
    assert distance == pytest.approx(float(toward.norm()) if ps else 0.0, rel=1e-9, abs=1e-12)


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 300),
    a_dtype=st.sampled_from(FLOATS),
    b_dtype=st.sampled_from(FLOATS),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_a_difference_with_a_narrower_copy_has_the_bits_of_torch_sub(
    numel: int, a_dtype: torch.dtype, b_dtype: torch.dtype, scale: float, seed: int
) -> None:
    """``subtract_into`` (a float16 copy converted first, for speed) writes exactly what
    ``torch.sub`` does, into an output of the promoted dtype, whichever operand is narrower."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(numel, generator=gen) * scale).to(a_dtype)
    b = (a.float() + torch.randn(numel, generator=gen) * scale * 0.01).to(b_dtype)
    out_dtype = torch.promote_types(a_dtype, b_dtype)
    expected = torch.sub(a, b, out=torch.empty(numel, dtype=out_dtype))
    got = subtract_into(a, b, torch.empty(numel, dtype=out_dtype))
    assert torch.equal(got, expected)
    assert got.dtype == out_dtype


def track(spec: str, dtype: torch.dtype) -> tuple[float, float]:
    """Leader and follower of one edge, copies in ``dtype``, x moved by training between 60
    updates: after every update the follower's mirror equals the leader's public copy bit
    for bit (the checksum holds). Returns max |x − x̂| and max |x| at the end."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20_000, generator=gen)
    c = Copies(from_spec(spec), from_spec("none"), SpilledTensor(x), dtype=dtype)

    def copies() -> dict:
        return dict(
            public=torch.zeros(x.shape, dtype=dtype), mirror=torch.zeros(x.shape, dtype=dtype)
        )

    leader, follower = Edge(**copies(), leader=True), Edge(**copies(), leader=False)
    for seq in range(1, 61):
        x.add_(torch.randn(x.shape, generator=gen), alpha=1e-3)
        kind, payload = leader.encode_next(x, c, early=True, seed=1)
        assert kind is (Kind.INIT if seq == 1 else Kind.DELTA)
        update = Incoming(
            epoch=leader.epoch,
            seq=seq,
            kind=kind,
            checksum=tensor_checksum(leader.public),
            weight=0.5,
            payload=payload,
        )
        leader.record_sent(update, 0.5, seq)
        assert follower.admit(update) is None
        assert follower.apply(update, c) is Verdict.ACCEPTED
        assert torch.equal(follower.mirror, leader.public)
        follower.done_mixing()
        leader.answered(leader.epoch, seq, Verdict.ACCEPTED)
        leader.done_mixing()
    return float((x - leader.public.float()).abs().max()), float(x.abs().max())


@pytest.mark.parametrize("spec", ["topk:0.05+int8", "sign", "int8"])
def test_float16_copies_stay_identical_at_both_ends_and_track_x(spec: str) -> None:
    """float16 copies stay bit-identical across the edge, and error feedback keeps them as
    close to x as float32 copies are, up to two float16 steps at x's largest value: the
    rounding is sent later, never lost."""
    (full, _), (half, largest) = track(spec, torch.float32), track(spec, torch.float16)
    step = float(torch.finfo(torch.float16).eps) * largest
    assert half <= full + 2 * step, (half, full, step)


def test_the_clip_of_a_float16_pull_is_measured_in_float32() -> None:
    """A pull of norm ~9e4 between float16 copies: its squares overflow float16, and a norm
    summed there was infinite, which dropped the pull whole instead of clipping it."""
    mirror = torch.full((100_000,), 300.0, dtype=torch.float16)
    public = torch.zeros(100_000, dtype=torch.float16)
    expected = 10.0 / float((mirror.float() - public.float()).norm())
    assert mixing.clip_scale(mirror, public, 10.0) == pytest.approx(expected, rel=1e-3)


@pytest.mark.skipif(not native.available(), reason=native.status())
@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 3000),
    neighbours=st.integers(1, 4),
    copies=st.sampled_from([torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_the_fused_consensus_step_is_the_sliced_one(
    numel: int, neighbours: int, copies: torch.dtype, seed: int
) -> None:
    """compression/kernels.c's step (float32 x, each edge's mirror against its own public
    copy, float16 or float32 copies) moves x as the slices do and measures the same pull,
    within rounding: its differences of float16 copies are taken in float32 (torch's in
    float16: exact where the copies are within a factor 2 of each other, as close copies
    are), its weighted sums in another order. A tensor given as ``also_into`` is written the
    new x in the same pass."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    publics = [torch.randn(numel, generator=gen).to(copies) for _ in range(neighbours)]
    ps = [
        Pair(
            (public.float() + 0.01 * torch.randn(numel, generator=gen)).to(copies),
            public,
            float(torch.rand(1, generator=gen)) + 0.1,
        )
        for public in publics
    ]
    fused, also = x.clone(), torch.full_like(x, float("nan"))
    distance = consensus_step(fused, ps, 0.5, also_into=also)
    assert torch.equal(also, fused)  # written in the same pass, the same bits
    alone = x.clone()
    consensus_step(alone, ps, 0.5)
    assert torch.equal(alone, fused)
    lib, native._lib = native._lib, None
    try:
        sliced = x.clone()
        sliced_distance = consensus_step(sliced, ps, 0.5)
    finally:
        native._lib = lib
    torch.testing.assert_close(fused, sliced, rtol=1e-6, atol=1e-5)
    assert distance == pytest.approx(sliced_distance, rel=1e-3)
    assert not torch.equal(fused, x)  # it moved
