"""Cheap checks of an event's arrays, shared by the events' validators (`schemas.events`).

They live in the events' own validators, so that every reader of every stream gets them from
`decode`: arrays in their documented dtype and rank, token ids and versions >= 0, log-probs
finite and <= 0, rewards and advantages finite. A NaN log-prob or reward that decoded fine
would reach the loss and poison the model; a negative token id would crash an embedding lookup.
Checks that need the model (token ids < vocabulary size, lengths <= context, a weight manifest
that fits) belong to the workers that hold it (`consumers.checks`,
`engines.weights.check_manifest`).
"""

from __future__ import annotations

import numpy as np

from schemas.tensor import ITEMSIZE, DType, Tensor

_INT32 = np.dtype("<i4")


def expect(name: str, tensor: Tensor, dtype: DType, ndim: int) -> None:
    """Raise unless `tensor` has the documented dtype and rank, and bytes to match."""
    if tensor.dtype != dtype or len(tensor.shape) != ndim:
        raise ValueError(
            f"{name} must be {dtype} with {ndim} dimension(s), "
            f"got {tensor.dtype}{list(tensor.shape)}"
        )
    tensor.check()


def checked_values(name: str, tensor: Tensor, dtype: DType, ndim: int) -> np.ndarray:
    """The values of `tensor`, once `expect` holds."""
    expect(name, tensor, dtype, ndim)
    return tensor.numpy()


def vectors(dtype: DType, tensors: dict[str, Tensor]) -> None:
    """Raise unless each of these tensors is 1-D of `dtype`, with bytes to match.

    `expect` for several vectors in one loop: at trajectory sizes the calls were a quarter
    of the validator's time, and `expect` then only words the reason.
    """
    itemsize = ITEMSIZE[dtype]
    for name, tensor in tensors.items():
        if (
            tensor.dtype != dtype
            or len(tensor.shape) != 1
            or len(tensor.data) != tensor.shape[0] * itemsize
        ):
            expect(name, tensor, dtype, 1)


def non_negative(tensors: dict[str, Tensor]) -> None:
    """Raise unless every value of these int32 tensors (checked by `expect`) is >= 0.

    One reduction over their joined bytes: at trajectory sizes numpy's ~1 µs per call is
    most of the work, and a reduction per array was a fifth of a trajectory's decode. The
    ufunc's own `reduce`, not `ndarray.min`, which adds a Python-level wrapper per call.
    """
    joined = np.frombuffer(b"".join([t.data for t in tensors.values()]), _INT32)
    if joined.size and np.minimum.reduce(joined) < 0:
        name = next(name for name, t in tensors.items() if t.numpy().min(initial=0) < 0)
        raise ValueError(f"{name} holds a negative value")


def at_least(name: str, values: np.ndarray, low: int) -> None:
    if values.size and np.minimum.reduce(values, axis=None) < low:
        raise ValueError(f"{name} holds {values.min()}, below {low}")


def log_probs(name: str, values: np.ndarray) -> None:
    # A NaN makes max() NaN, which fails `<= 0`; two reductions cost half of an elementwise test.
    if values.size and not (
        np.maximum.reduce(values, axis=None) <= 0 and np.minimum.reduce(values, axis=None) > -np.inf
    ):
        raise ValueError(f"{name} must be finite and <= 0 (log-probabilities)")


def finite(name: str, values: np.ndarray) -> None:
    if not np.isfinite(values).all():
        raise ValueError(f"{name} must be finite")
