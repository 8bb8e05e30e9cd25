"""The input dtypes attngen runs, by the names the command line, the registry and the tuner use."""

from __future__ import annotations

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # name -> torch dtype
NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> name
BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}  # name -> bytes an element
SUPPORTED = tuple(DTYPES.values())


def parse(name: str, option: str = "--dtype") -> torch.dtype:
    """The torch dtype of a name; a ValueError naming `option` for anything else."""
    if name not in DTYPES:
        raise ValueError(f"{option} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
