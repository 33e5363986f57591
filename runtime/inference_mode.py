"""Classes whose methods all run under torch.inference_mode() (the offload's rooms, the CPU path)."""
from __future__ import annotations

import functools

import torch


def inference_mode_methods(cls):
    """Run every method of `cls` under torch.inference_mode(): the tables, masks and counters these
    classes update in place were created while exllamav2 loaded the model (inside inference mode), and
    torch refuses in-place updates of such tensors outside it."""
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not isinstance(fn, (staticmethod, classmethod, type)) and (
                not name.startswith("__") or name == "__init__"):
            setattr(cls, name, functools.wraps(fn)(torch.inference_mode()(fn)))
    return cls
