"""Hypothesis strategies for poison: malformed messages made by mutating the golden events.

Each strategy starts from a golden event's wire map (`tests/golden/*.msgpack`) and breaks it
the way real poison is broken: keys dropped or inserted, values of the wrong type, arrays
with NaN/inf, out-of-range ids, the wrong dtype or shape, truncated tensors, unknown types,
future schema versions; or the encoded bytes truncated, bit-flipped, or replaced by random
bytes. `tests/test_poison.py` feeds them to `decode` and to the real workers.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st

from schemas import DecodeError, Event, decode
from tests.golden_events import GOLDEN, golden

KeyPath = tuple[str | int, ...]
WireMap = dict[str, Any]

GOLDEN_MAPS: dict[str, WireMap] = {
    name: msgpack.unpackb((GOLDEN / f"{name}.msgpack").read_bytes()) for name in golden()
}
"""Every golden event version as the msgpack map it travels as, by name (e.g. "prompt.v1")."""

SPECIAL_FLOATS = (math.nan, math.inf, -math.inf)
BAD_INTS = (-1, -(2**31), 10**9, 2**31 - 1)
# Any value msgpack can carry, big and small, right and wrong for whatever field it lands in.
msgpack_values: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def paths(value: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    """Every key/index path inside nested maps and lists, outermost first."""
    found: list[KeyPath] = []
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in items:
        found.append((*prefix, key))
        found += paths(child, (*prefix, key))
    return found


def tensor_paths(value: WireMap) -> list[KeyPath]:
    """Paths of the tensors (`{dtype, shape, data}` maps) inside a wire map."""
    return [p for p in paths(value) if _is_tensor(_get(value, p))]


def _is_tensor(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}


def _get(tree: Any, path: KeyPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: WireMap, path: KeyPath, value: Any) -> WireMap:
    out = copy.deepcopy(tree)
    _get(out, path[:-1])[path[-1]] = value
    return out


def _drop(tree: WireMap, path: KeyPath) -> WireMap:
    out = copy.deepcopy(tree)
    parent = _get(out, path[:-1])
    del parent[path[-1]]
    return out


def _array(tensor: WireMap) -> np.ndarray:
    """A writable copy of a wire tensor's values (golden tensors have numpy dtypes)."""
    return (
        np.frombuffer(tensor["data"], np.dtype(tensor["dtype"]).newbyteorder("<"))
        .reshape(tensor["shape"])
        .copy()
    )


def _wire(array: np.ndarray) -> WireMap:
    data = array.astype(array.dtype.newbyteorder("<")).tobytes()
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": data}


def poisoned_tensor(tensor: WireMap) -> st.SearchStrategy[WireMap]:
    """A tensor with a NaN/inf, an out-of-range value, another dtype or shape, or short data."""
    values = _array(tensor)
    flat = st.integers(0, max(values.size - 1, 0))

    def with_value(index: int, value: float) -> WireMap:
        # Keep the tensor's dtype when the value is of its kind, so that only the value is wrong.
        same_kind = isinstance(value, float) == (values.dtype.kind == "f")
        changed = (
            values.copy()
            if same_kind
            else values.astype(np.float64 if isinstance(value, float) else np.int64)
        )
        changed.flat[index] = np.array(value).astype(changed.dtype)  # wraps where it does not fit
        return _wire(changed)

    return st.one_of(
        st.builds(with_value, flat, st.sampled_from(SPECIAL_FLOATS)),
        st.builds(with_value, flat, st.sampled_from(BAD_INTS)),
        st.sampled_from(["float64", "int64", "bool", "int8", "float16"]).map(
            lambda d: _wire(values.astype(d))
        ),
        st.sampled_from([(*values.shape, 1), values.shape[:-1], (values.size + 1,)]).map(
            lambda shape: {**tensor, "shape": list(shape)}
        ),
        st.integers(0, max(len(tensor["data"]) - 1, 0)).map(
            lambda n: {**tensor, "data": tensor["data"][:n]}
        ),
    )


def mutated_map(fields: WireMap) -> st.SearchStrategy[WireMap]:
    """One golden map broken in one way (the result may still happen to be valid)."""
    every = paths(fields)
    tensors = tensor_paths(fields)
    strategies = [
        st.sampled_from(every).map(lambda p: _drop(fields, p)),
        st.tuples(st.sampled_from(every), msgpack_values).map(lambda pv: _set(fields, *pv)),
        st.tuples(st.text(min_size=1, max_size=8), msgpack_values).map(
            lambda kv: {**fields, kv[0]: kv[1]}
        ),
        st.integers(2, 2**63 - 1).map(lambda v: {**fields, "schema_version": v}),
        st.sampled_from(["jetrl.nope", "", *{m["type"] for m in GOLDEN_MAPS.values()}]).map(
            lambda t: {**fields, "type": t}
        ),
    ]
    if tensors:
        strategies.append(
            st.sampled_from(tensors).flatmap(
                lambda p: poisoned_tensor(_get(fields, p)).map(lambda t: _set(fields, p, t))
            )
        )
    return st.one_of(strategies)


def broken_bytes(data: bytes) -> st.SearchStrategy[bytes]:
    """Valid bytes truncated, with a byte changed, or with junk appended."""
    return st.one_of(
        st.integers(0, len(data) - 1).map(lambda n: data[:n]),
        st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)).map(
            lambda iv: data[: iv[0]] + bytes([iv[1]]) + data[iv[0] + 1 :]
        ),
        st.binary(min_size=1, max_size=8).map(lambda junk: data + junk),
    )


def malformed(name: str) -> st.SearchStrategy[bytes]:
    """Poison made from the golden event `name`: a mutated map, broken bytes, or random bytes."""
    fields = GOLDEN_MAPS[name]
    return st.one_of(
        mutated_map(fields).map(lambda m: msgpack.packb(m, use_bin_type=True)),
        broken_bytes(msgpack.packb(fields, use_bin_type=True)),
        st.binary(max_size=64),
        msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    )


def one_of_each_kind(name: str, oversize: int) -> list[bytes]:
    """One message of each kind of poison made from the golden event `name`: garbage,
    truncated msgpack, valid msgpack of the wrong shape, an unknown type, a future schema
    version, `oversize` bytes, and per tensor one NaN (float) or negative (int) value."""
    fields = GOLDEN_MAPS[name]
    data = msgpack.packb(fields, use_bin_type=True)
    kinds = [
        b"\x00\xffnot an event",
        data[: len(data) // 2],
        msgpack.packb([fields], use_bin_type=True),
        msgpack.packb({**fields, "type": "jetrl.nope"}, use_bin_type=True),
        msgpack.packb({**fields, "schema_version": 99}, use_bin_type=True),
        b"\x93" + bytes(oversize - 1),
    ]
    for path in tensor_paths(fields):
        values = _array(_get(fields, path))
        bad = math.nan if values.dtype.kind == "f" else -1
        values.flat[0] = np.array(bad).astype(values.dtype)  # -1 wraps to 255 in a uint8 mask
        kinds.append(msgpack.packb(_set(fields, path, _wire(values)), use_bin_type=True))
    return kinds


def undecodable(name: str, expected: type[Event]) -> st.SearchStrategy[bytes]:
    """`malformed(name)` that `decode(data, expected)` refuses: certain poison for that stream."""
    return malformed(name).filter(lambda data: _refused(data, expected))


def _refused(data: bytes, expected: type[Event]) -> bool:
    try:
        decode(data, expected)
    except DecodeError:
        return True
    return False
