"""Delta versions: bit-exact rebuild after a real AdamW step, refusals that leave the base
untouched, the full-every-K chain and what a worker fetches, and the sharding of tensors."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from engines.delta_plan import (
    Chain,
    Fetch,
    ShardLayout,
    assign_shards,
    next_publication,
    plan_fetch,
)
from engines.weight_delta import META_KEY, apply_delta, encode_shard, read_shard
from engines.weights import ChecksumMismatch, WeightsRefused
from producers.tasks import VOCAB
from schemas import TensorSpec

Weights = dict[str, torch.Tensor]
# Bit patterns a float comparison would hide, and moves across zero (ordered-int changes).
SPECIALS = [-0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3.0]
MOVED = [0.0, -0.0, -float("nan"), -float("inf"), 1.0, -1e-40, 1e-40, -3.0]


def snapshot(model: torch.nn.Module, dtype: torch.dtype) -> Weights:
    return {
        name: p.detach().to(dtype, copy=True).contiguous() for name, p in model.named_parameters()
    }


def adamw_step(
    model_dir: Path, train: torch.dtype, publish: torch.dtype
) -> tuple[Weights, Weights]:
    """(before, after) one real AdamW step at lr 1e-6, trained in `train`,
    published in `publish`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=train)
    before = snapshot(model, publish)
    ids = torch.randint(0, len(VOCAB), (4, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-6).step()
    return before, snapshot(model, publish)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def same_bits(a: Weights, b: Weights) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a
    )


def copy(weights: Weights) -> Weights:
    return {name: t.clone() for name, t in weights.items()}


def publish(
    base: Weights, new: Weights, world: int, base_version: int | None = 0
) -> tuple[list[bytes], list[TensorSpec]]:
    """Every rank's shard of version 1, as the trainer ranks would write them."""
    shards = assign_shards({name: t.nbytes for name, t in new.items()}, world)
    out = [
        encode_shard(base, new, names, version=1, base_version=base_version, rank=r, world=world)
        for r, names in enumerate(shards)
    ]
    return [payload for payload, _ in out], [spec for _, specs in out for spec in specs]


def encodings(payloads: list[bytes]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for payload in payloads:
        for entry in read_shard(payload)[0].tensors:
            counts[entry.encoding] = counts.get(entry.encoding, 0) + 1
    return counts


@pytest.mark.parametrize(
    ("train", "publish_as"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
    ids=["bf16", "fp32-master-bf16", "fp32"],
)
def test_delta_after_an_adamw_step_rebuilds_the_weights_bit_for_bit(
    model_dir: Path, train: torch.dtype, publish_as: torch.dtype
) -> None:
    before, after = adamw_step(model_dir, train, publish_as)
    changed = sum(int((bits(before[k]) != bits(after[k])).sum()) for k in after)
    assert changed > 0, "the step changed nothing: the test would prove nothing"
    payloads, manifest = publish(before, after, world=2)
    weights = copy(before)
    apply_delta(weights, payloads, manifest, version=1, base_version=0)
    assert same_bits(weights, after)
    full = sum(t.nbytes for t in after.values())
    if publish_as == torch.bfloat16:  # few bf16 elements move at lr 1e-6: stored as changes, small
        assert encodings(payloads).get("sparse", 0) > 0
        assert sum(map(len, payloads)) < 0.1 * full
    else:  # every float32 element moves: stored densely, zlib drops the changes' zero high bytes
        assert encodings(payloads).get("dense", 0) > 0
        assert sum(map(len, payloads)) < 0.5 * full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_special_bit_patterns_and_moves_across_zero_round_trip(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    base = {
        "a": torch.randn(300, generator=generator).to(dtype),
        "b": torch.randn(16, 64, generator=generator).to(dtype),
    }
    base["a"][: len(SPECIALS)] = torch.tensor(SPECIALS).to(dtype)
    new = copy(base)
    new["a"][: len(MOVED)] = torch.tensor(MOVED).to(dtype)  # sparse: 8 of 300 move
    new["a"][-1] = torch.tensor(float("nan")).to(dtype)
    new["b"] = (base["b"].double() * (1 + 2**-6 if dtype == torch.bfloat16 else 1e-5)).to(
        dtype
    )  # dense: all move
    payloads, manifest = publish(base, new, world=1)
    assert encodings(payloads) == {"sparse": 1, "dense": 1}
    weights = copy(base)
    apply_delta(weights, payloads, manifest, version=1, base_version=0)
    assert same_bits(weights, new)


def test_a_full_version_in_the_same_format_loads_from_nothing(model_dir: Path) -> None:
    _, after = adamw_step(model_dir, torch.bfloat16, torch.bfloat16)
    payloads, manifest = publish({}, after, world=3, base_version=None)
    assert set(encodings(payloads)) == {"full"}
    weights: Weights = {}
    apply_delta(weights, payloads, manifest, version=1, base_version=None)
    assert same_bits(weights, after)


def rewrite(payload: bytes, name: str, edit: Callable[[bytes], bytes]) -> bytes:
    """`payload` with the stored changes of tensor `name` edited,
    as a valid zlib stream and header."""
    header, stored = read_shard(payload)
    raw = edit(zlib.decompress(stored[name].numpy().tobytes()))
    stored[name] = torch.frombuffer(bytearray(zlib.compress(raw)), dtype=torch.uint8)
    return save(stored, metadata={META_KEY: header.model_dump_json()})


@pytest.fixture(scope="module")
def step(model_dir: Path) -> tuple[Weights, Weights, list[bytes], list[TensorSpec]]:
    before, after = adamw_step(model_dir, torch.bfloat16, torch.bfloat16)
    return before, after, *publish(before, after, world=2)


def test_a_tampered_change_is_refused_and_every_tensor_is_restored(step: tuple) -> None:
    before, _, payloads, manifest = step
    header = read_shard(payloads[-1])[0]
    last = [e.name for e in header.tensors if e.encoding in ("sparse", "dense")][-1]
    assert any(e.encoding != "same" for e in read_shard(payloads[0])[0].tensors), (
        "nothing changes before it"
    )
    tampered = [
        *payloads[:-1],
        rewrite(payloads[-1], last, lambda raw: raw[:-1] + bytes([(raw[-1] + 1) % 256])),
    ]
    weights = copy(before)
    with pytest.raises(
        ChecksumMismatch, match=rf"tensor {last}: v0 \+ delta does not give v1's checksum"
    ):
        apply_delta(weights, tampered, manifest, version=1, base_version=0)
    assert same_bits(weights, before)


def test_changes_longer_or_shorter_than_their_header_says_are_refused(step: tuple) -> None:
    before, _, payloads, manifest = step
    name = next(e.name for e in read_shard(payloads[0])[0].tensors if e.encoding == "sparse")
    for edit in (lambda raw: raw + bytes(1 << 20), lambda raw: raw[:-1]):
        weights = copy(before)
        with pytest.raises(
            ChecksumMismatch, match=rf"shard 0: tensor {name}: changes do not match its header"
        ):
            apply_delta(
                weights,
                [rewrite(payloads[0], name, edit), payloads[1]],
                manifest,
                version=1,
                base_version=0,
            )
        assert same_bits(weights, before)
    header, stored = read_shard(payloads[0])
    # More changes than the tensor has elements, each stored: refused before inflating them.
    count = before[name].numel() + 1
    entry = next(e for e in header.tensors if e.name == name)
    inflated = header.model_copy(
        update={
            "tensors": tuple(
                e.model_copy(update={"count": count}) if e.name == name else e
                for e in header.tensors
            )
        }
    )
    blob = zlib.compress(
        bytes(count * (np.dtype(entry.gaps).itemsize + np.dtype(entry.diffs).itemsize))
    )
    stored[name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    weights = copy(before)
    with pytest.raises(
        ChecksumMismatch, match=rf"shard 0: tensor {name}: changes do not match its header"
    ):
        apply_delta(
            weights,
            [save(stored, metadata={META_KEY: inflated.model_dump_json()}), payloads[1]],
            manifest,
            version=1,
            base_version=0,
        )
    assert same_bits(weights, before)


def test_a_delta_applied_onto_the_wrong_base_is_refused(step: tuple) -> None:
    _, after, payloads, manifest = step
    weights = copy(after)  # already at v1: v1's delta onto it is the wrong base
    with pytest.raises(ChecksumMismatch, match=r"wrong base or corrupt delta"):
        apply_delta(weights, payloads, manifest, version=1, base_version=0)
    assert same_bits(weights, after)


def test_shards_that_disagree_with_the_manifest_or_version_are_refused(step: tuple) -> None:
    before, _, payloads, manifest = step
    forged = [manifest[0].model_copy(update={"sha256": "0" * 64}), *manifest[1:]]
    cases = [
        (payloads, forged, 1, 0, ChecksumMismatch, r"shard header disagrees with v1's manifest"),
        (
            payloads[:1],
            manifest,
            1,
            0,
            WeightsRefused,
            r"shards of ranks \[0\] with world sizes \[2\]",
        ),
        (
            payloads,
            manifest,
            2,
            1,
            WeightsRefused,
            r"shard 0 is v1 on base 0, expected v2 on base 1",
        ),
        (payloads, manifest[1:], 1, 0, WeightsRefused, r"do not carry each manifest tensor once"),
        (
            [payloads[0], b"\x00" * 16],
            manifest,
            1,
            0,
            ChecksumMismatch,
            r"not a jetrl-delta/1 shard",
        ),
    ]
    weights = copy(before)
    del weights[manifest[0].name]
    with pytest.raises(WeightsRefused, match=r"base weights' names differ from v1's manifest"):
        apply_delta(weights, payloads, manifest, version=1, base_version=0)
    for shards, specs, version, base_version, error, message in cases:
        weights = copy(before)
        with pytest.raises(error, match=message):
            apply_delta(weights, shards, specs, version=version, base_version=base_version)
        assert same_bits(weights, before)


def test_full_every_k_versions_and_a_restart_starts_a_new_chain() -> None:
    chain, published = None, []
    for version in range(0, 16, 2):  # sync_every 2, full_every 3
        base, chain = next_publication(version, chain, full_every=3)
        published.append((version, base, chain.full))
    assert published == [
        (0, None, 0),
        (2, 0, 0),
        (4, 2, 0),
        (6, None, 6),
        (8, 6, 6),
        (10, 8, 6),
        (12, None, 12),
        (14, 12, 12),
    ]
    assert next_publication(9, None, full_every=3) == (
        None,
        Chain(full=9, last=9),
    )  # a resumed trainer holds no base
    assert [next_publication(v, Chain(0, v - 1), 1)[0] for v in (1, 2)] == [
        None,
        None,
    ]  # full_every 1: deltas off
    with pytest.raises(ValueError, match="not after the chain's last version"):
        next_publication(4, Chain(full=0, last=4), full_every=3)
    for base, full, message in [
        (None, 0, "its own chain's full version"),
        (4, 0, "base must lie in its chain"),
        (1, 2, "base must lie"),
    ]:
        with pytest.raises(ValueError, match=message):
            ShardLayout(version=4, base_version=base, full_version=full, shards=(("a",),))


def test_a_worker_fetches_the_chain_it_lacks_in_order() -> None:
    assert plan_fetch(10, full=6, have=8, every=2) == (Fetch(10, 8),)
    assert plan_fetch(10, full=6, have=6, every=2) == (Fetch(8, 6), Fetch(10, 8))
    for have in (
        None,
        4,
        7,
        12,
    ):  # none, before the full version, off the chain's step, ahead after a restart
        assert plan_fetch(10, full=6, have=have, every=2) == (
            Fetch(6, None),
            Fetch(8, 6),
            Fetch(10, 8),
        ), have
    assert plan_fetch(6, full=6, have=4, every=2) == (Fetch(6, None),)
    assert plan_fetch(10, full=6, have=10, every=2) == ()
    with pytest.raises(ValueError, match="not on a chain"):
        plan_fetch(9, full=6, have=None, every=2)


def test_every_fetch_a_plan_asks_for_was_published() -> None:
    chain, published, full_of = None, set(), {}
    for version in range(0, 40, 3):
        base, chain = next_publication(
            version, chain if version != 21 else None, full_every=4
        )  # a restart at 21
        published.add(Fetch(version, base))
        full_of[version] = chain.full
    for target, full in full_of.items():
        for have in [None, *full_of]:
            plan = plan_fetch(target, full=full, have=have, every=3)
            assert set(plan) <= published, (target, have, plan)
            assert all(later.base == earlier.version for earlier, later in pairwise(plan))
            assert not plan or plan[0].base is None or plan[0].base == have


def test_shards_cover_every_tensor_exactly_once_balanced_by_bytes(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    sizes = {name: p.nbytes for name, p in model.named_parameters()}
    for world in range(1, len(sizes) + 3):
        shards = assign_shards(sizes, world)
        names = [name for shard in shards for name in shard]
        assert len(shards) == world and sorted(names) == sorted(sizes), world
        loads = [sum(sizes[n] for n in shard) for shard in shards]
        # Largest first onto the least loaded: the fullest rank was the emptiest when it took its
        # last tensor.
        fullest = shards[loads.index(max(loads))]
        assert max(loads) - min(loads) <= min(sizes[n] for n in fullest), (world, loads)
        assert assign_shards(dict(reversed(sizes.items())), world) == tuple(
            tuple(reversed(shard)) for shard in shards
        ), "the assignment depends on the order sizes come in"
        ShardLayout(version=1, base_version=0, full_version=0, shards=shards).check(
            [TensorSpec(name=n, dtype="bfloat16", shape=(1,), sha256="0" * 64) for n in sizes]
        )
    norm = [TensorSpec(name="model.norm.weight", dtype="bfloat16", shape=(1,), sha256="0" * 64)]
    for shards, message in [
        (
            (("model.norm.weight",), ("lm_head.x",)),
            r"1 missing or extra \['lm_head.x'\], repeated \[\]",
        ),
        (
            (("model.norm.weight",), ("model.norm.weight",)),
            r"0 missing or extra \[\], repeated \['model.norm.weight'\]",
        ),
    ]:
        with pytest.raises(WeightsRefused, match=message):
            ShardLayout(version=1, base_version=0, full_version=0, shards=shards).check(norm)
