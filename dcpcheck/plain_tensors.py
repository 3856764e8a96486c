"""Reading a tensor without its class's code: a plain ``torch.Tensor`` over
the same memory. What the implementation hands back may be a tensor subclass
whose ``__torch_function__`` lies (every comparison equal, every copy the
expected values); the input check and the output comparison read only
through this view, so it never runs."""

from __future__ import annotations

import torch


class UnreadableTensorError(TypeError):
    """A tensor subclass whose elements are not plain memory (a wrapper subclass, a meta tensor)."""


def plain(value):
    """``value`` as a plain tensor over the elements it views now (itself when
    it is one); anything that is not a tensor as it is."""
    with torch._C.DisableTorchFunctionSubclass():
        if type(value) is torch.Tensor or not isinstance(value, torch.Tensor):
            return value
        try:
            if value.device.type == "meta" or value.layout != torch.strided:
                raise RuntimeError(f"a {value.layout} tensor on {value.device}")
            storage = value.untyped_storage()
            storage.data_ptr()  # raises for a wrapper subclass's storage, which has no memory behind it
            return plain_over(storage, value.dtype, value.storage_offset(), value.shape, value.stride())
        except (RuntimeError, NotImplementedError) as exc:
            why = " ".join(str(exc).split())
            raise UnreadableTensorError(
                f"a {type(value).__name__} (a torch.Tensor subclass) whose elements cannot be read as plain "
                f"memory ({why[:200]}); accepted: plain tensors, or subclasses over plain strided memory"
            ) from None


def plain_over(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, shape, stride) -> torch.Tensor:
    """A plain tensor of ``dtype`` over ``storage`` with ``offset``, ``shape`` and ``stride``, in elements."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
