"""Events round-trip through the codec; golden bytes decode; bad bytes fail with a reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas import DecodeError, PromptEvent, RewardEvent, Tensor, TrajectoryEvent, decode, encode
from schemas.codec import UPGRADES, register_upgrade
from tests.golden_events import GOLDEN, current, golden

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
arrays = st.sampled_from(DTYPES).flatmap(
    lambda d: hnp.arrays(
        np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    )
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(),
)
metadata = st.dictionaries(
    st.text(min_size=1, max_size=10),
    st.recursive(json_scalars, lambda c: st.lists(c, max_size=3)),
    max_size=4,
)


@given(arrays)
def test_tensor_round_trips_any_array(array: np.ndarray) -> None:
    back = Tensor.from_numpy(array).numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == np.ascontiguousarray(array).tobytes()


def test_bfloat16_round_trips_through_torch() -> None:
    t = torch.tensor([[1.5, -2.0], [3.25, 1e-3]], dtype=torch.bfloat16)
    wire = Tensor.from_torch(t)
    assert wire.dtype == "bfloat16" and wire.shape == (2, 2) and wire.nbytes == 8
    assert torch.equal(decode_tensor(wire).torch(), t)


def decode_tensor(t: Tensor) -> Tensor:
    return Tensor.model_validate(msgpack.unpackb(msgpack.packb(t.model_dump())))


@settings(max_examples=60, deadline=None)
@given(
    tokens=hnp.arrays(np.int32, st.integers(0, 64), elements=st.integers(0, 2**31 - 1)),
    meta=metadata,
    text=st.text(max_size=50),
    sample=st.integers(0, 7),
)
def test_trajectory_and_reward_round_trip(
    tokens: np.ndarray, meta: dict, text: str, sample: int
) -> None:
    n = tokens.shape[0]
    traj = TrajectoryEvent(
        id=f"r/0/1/{sample}",
        run="r",
        prompt_id="r/0/1",
        sample_index=sample,
        group_size=8,
        # A prompt has at least one token; the response may be empty.
        prompt_ids=Tensor.from_numpy(np.concatenate([tokens[: n // 2], np.ones(1, np.int32)])),
        response_ids=Tensor.from_numpy(tokens),
        logprobs=Tensor.from_numpy(-np.abs(tokens.astype(np.float32))),
        versions=Tensor.from_numpy(np.zeros(n, np.int32)),
        response_text=text,
        task=meta,
    )
    assert decode(encode(traj)) == traj
    reward = RewardEvent(id=traj.id, run="r", trajectory=traj, reward=0.25, components={"a": 1.0})
    assert decode(encode(reward), RewardEvent) == reward


@pytest.mark.parametrize("name", sorted(golden()))
def test_golden_fixture_decodes(name: str) -> None:
    data = (GOLDEN / f"{name}.msgpack").read_bytes()
    event = golden()[name]
    assert decode(data) == event
    if not current(name, event):
        return  # an older version: it decodes through the upgrades to `event`, as checked
    # The same bytes for every field the file has; fields added to the version since (with
    # defaults, so that the file still decodes) are written at those defaults.
    written, stored = msgpack.unpackb(encode(event)), msgpack.unpackb(data)
    added = {key: written.pop(key) for key in set(written) - set(stored)}
    assert msgpack.packb(written) == data
    assert all(
        value == msgpack.unpackb(msgpack.packb(type(event).model_fields[key].default))
        for key, value in added.items()
    )


def _prompt_fields() -> dict:
    return msgpack.unpackb((GOLDEN / "prompt.v1.msgpack").read_bytes())


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
        (
            msgpack.packb({**_prompt_fields(), "type": "jetrl.nope"}),
            "unknown event type 'jetrl.nope'",
        ),
        (msgpack.packb({**_prompt_fields(), "schema_version": 9}), "newer than this worker's 1"),
        (msgpack.packb({**_prompt_fields(), "schema_version": 0}), "has no upgrade to 1"),
        (msgpack.packb({**_prompt_fields(), "n": 0}), "jetrl.prompt: n:"),
        (msgpack.packb({**_prompt_fields(), "surprise": 1}), "surprise"),
        (
            msgpack.packb(
                {
                    **_prompt_fields(),
                    "token_ids": {"dtype": "int32", "shape": [3], "data": b"\0" * 5},
                }
            ),
            "needs 12",
        ),
        ((GOLDEN / "prompt.v1.msgpack").read_bytes()[:-7], "not msgpack"),
    ],
)
def test_bad_bytes_fail_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason.replace("(", r"\(").replace("'", "'")):
        decode(data)


def test_wrong_event_type_for_the_stream_is_rejected() -> None:
    with pytest.raises(DecodeError, match="expected jetrl.trajectory here, got jetrl.prompt"):
        decode((GOLDEN / "prompt.v1.msgpack").read_bytes(), TrajectoryEvent)


def test_a_value_msgpack_cannot_pack_fails_encode_by_name() -> None:
    """Task fields are free-form: a numpy scalar (or any object) must not slip through as
    something else, nor fail with an unrelated error."""
    prompt = PromptEvent(
        id="r/0/0", run="r", epoch=0, index=0, prompt="c1=", task={"answer": np.float32(1.0)}
    )
    with pytest.raises(
        TypeError, match="an event field holds a float32, which msgpack cannot encode"
    ):
        encode(prompt)


def test_an_old_version_is_upgraded_on_decode() -> None:
    # A version-0 prompt called its samples "samples"; the upgrade renames the field.
    old = {**_prompt_fields(), "schema_version": 0, "samples": 2}
    del old["n"]

    @register_upgrade("jetrl.prompt", 0)
    def rename(fields: dict) -> dict:
        fields = dict(fields)
        fields["n"] = fields.pop("samples")
        return fields

    try:
        event = decode(msgpack.packb(old), PromptEvent)
    finally:
        del UPGRADES[("jetrl.prompt", 0)]
    assert event == golden()["prompt.v1"]


def test_export_writes_json_schema_for_every_event(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "schemas.export", str(tmp_path)], check=True, capture_output=True
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        f"jetrl.{k}.json"
        for k in (
            "batch.v3",
            "prompt.v1",
            "reward.v4",
            "reward_group.v1",
            "trajectory.v3",
            "trajectory_group.v1",
            "weights.v1",
        )
    ]
    assert '"response_mask"' in (tmp_path / "jetrl.trajectory.v3.json").read_text()
    assert '"earlier"' in (tmp_path / "jetrl.trajectory.v3.json").read_text()
