"""An array on the wire: `{dtype, shape, data}` with the raw little-endian bytes.

Arrays never travel as lists of Python numbers: packing 4k floats as a list costs ~1 ms,
as bytes ~20 µs (measured on 2 cores). numpy is the in-memory form; torch is converted lazily so
that light processes (producer, reward workers) never import it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeInt

if TYPE_CHECKING:
    import torch

# Wire dtype name -> numpy dtype. bfloat16 has no numpy dtype: its bytes travel as-is and
# are viewed as uint16 in numpy, as torch.bfloat16 in torch.
_NUMPY: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
_NUMPY["bfloat16"] = np.dtype("uint16")
# The same, little endian, made once: building it per call was a fifth of a trajectory's decode.
_LITTLE: dict[str, np.dtype] = {name: dtype.newbyteorder("<") for name, dtype in _NUMPY.items()}
ITEMSIZE: dict[str, int] = {name: dtype.itemsize for name, dtype in _NUMPY.items()}
"""Bytes per element of each wire dtype."""
DType = Literal[
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"
]


def itemsize(dtype: DType) -> int:
    """Bytes per element of a wire dtype."""
    return _NUMPY[dtype].itemsize


class Tensor(BaseModel):
    """A dense array: dtype name, shape, and C-order little-endian bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DType
    """One of bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64."""
    shape: tuple[NonNegativeInt, ...]
    """Dimensions, outermost first; () is a scalar."""
    data: bytes
    """math.prod(shape) * itemsize bytes, C order, little endian."""

    def check(self) -> None:
        """Raise ValueError unless the bytes fit dtype and shape.

        Not a pydantic validator: a Python validator per tensor doubled decode time, so
        each event's own validator checks its tensors (schemas.events._values).
        """
        expected = math.prod(self.shape) * _NUMPY[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"tensor data has {len(self.data)} bytes but {self.dtype}{list(self.shape)} needs "
                f"{expected}"
            )

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Tensor:
        name = array.dtype.name
        if name not in _NUMPY or name == "uint16":
            raise ValueError(f"cannot send numpy dtype {name}")
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        return cls(dtype=name, shape=tuple(array.shape), data=data)

    def numpy(self) -> np.ndarray:
        """A read-only view of the bytes (bfloat16 comes back as uint16 bits)."""
        flat = np.frombuffer(self.data, dtype=_LITTLE[self.dtype])
        return flat if len(self.shape) == 1 else flat.reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> Tensor:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return cls(
                dtype="bfloat16", shape=tuple(t.shape), data=t.view(torch.uint16).numpy().tobytes()
            )
        return cls.from_numpy(t.numpy())

    def torch(self) -> torch.Tensor:
        """A new torch tensor holding a copy of the data (bfloat16 restored)."""
        import torch

        array = self.numpy().copy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(array).view(torch.bfloat16)
        return torch.from_numpy(array)

    @property
    def nbytes(self) -> int:
        return len(self.data)
