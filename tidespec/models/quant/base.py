"""The base of tidespec's quantized linear layers: ``QuantizedLinear``, ``QuantizationError``, ``KERNEL_DTYPE``.

Why this exists: two modules build quantized layers on this base: ``models/quant/quantize.py`` (int8 / int4
weight-only layers on PyTorch's kernels, and ``quantize_model``, which swaps a model's projections
for any scheme's layers) and ``models/quant/a8.py`` (w4a8 / w8a8 layers on tidespec's integer
kernels). Since ``quant.py`` builds ``quant_a8.py``'s layers, the base lives here and the imports run
one way: ``quant`` -> ``quant_a8`` -> ``quant_base``. ``quant.py`` re-exports these names, so
``from tidespec.models.quant.quantize import QuantizedLinear`` keeps working.

Worked example (a subclass supplies ``_kernel``; the base casts, pieces and adds the bias)::

    class Dense(QuantizedLinear):
        def __init__(self, w):
            super().__init__(w.shape[1], w.shape[0], None)
            self.w = w.to(KERNEL_DTYPE)
        def _kernel(self, xb):                       # xb [T, K] bfloat16 -> [T, N] bfloat16
            return xb @ self.w.T
    Dense(torch.randn(8, 4))(torch.randn(3, 4)).dtype   # torch.float32 (x's dtype)
"""

from __future__ import annotations

import torch
from torch import nn

from tidespec.models.kernels.rows import in_pieces
from tidespec.models.target import ModelConfigError

KERNEL_DTYPE = torch.bfloat16  # the activation dtype both weight-only kernels are vectorised for


class QuantizationError(ModelConfigError):
    """This model cannot be quantized as asked (group size, device); the message is one line."""


class QuantizedLinear(nn.Module):
    """Base of the quantized replacements of ``llama.Linear``: ``forward(x [T, in]) -> [T, out]`` in
    ``x``'s dtype. The kernel's tensors are buffers (int8/uint8 weights, bfloat16 scales): they move
    with ``.to(device)``, and ``.to(dtype)`` leaves the scales in bfloat16 (the kernels need it).
    An optional ``bias [out]`` is kept in the dtype it came in and added after the cast back."""

    bias: torch.Tensor | None
    _kernel_buffers: tuple[str, ...] = ()
    # rows up to which the kernel was measured row-invariant when that is below the engine's token
    # budget: calls run in pieces within it (models/execution/invariance.py); 0 = whole calls
    row_limit = 0
    own_kernel = False  # tidespec's kernel (csrc/quant_linear.cpp) instead of PyTorch's: the same bits
    kernel_dtype = KERNEL_DTYPE  # the dtype of the kernel's floating-point buffers (scales)
    scheme = ""  # w4a8 / w8a8 layers (models/quant/a8.py) name their scheme; quantization_of reads it

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's signature
        super()._apply(fn, recurse)
        for name in self._kernel_buffers:  # a model-wide .to(float64) must not touch the kernel's scales
            buf = getattr(self, name)
            if buf.is_floating_point() and buf.dtype != self.kernel_dtype:
                setattr(self, name, buf.to(self.kernel_dtype))
            if buf.device.type != "cpu":  # tidespec's kernels are CPU ops
                self.own_kernel = False
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        xb = x.to(KERNEL_DTYPE).contiguous()
        if not self.row_limit:
            y = self._kernel(xb)
        elif torch.compiler.is_compiling():  # an op of its own keeps the graph's row count symbolic
            y = self._compiled_in_pieces(xb)
        else:  # eager calls the kernel directly (a custom op's Python dispatch costs ~70 us a call)
            y = in_pieces(self._kernel, xb, self.row_limit)
        return self._finish(y, x.dtype)

    @property
    def kernel_name(self) -> str:
        """Which kernel the layer runs: part of the key its measured row frontier is cached under."""
        return "tidespec" if self.own_kernel else "aten"

    def _kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The kernel on bfloat16 rows: xb [T, K] -> [T, N] bfloat16."""
        raise NotImplementedError

    def _compiled_in_pieces(self, xb: torch.Tensor) -> torch.Tensor:
        """``_kernel`` in row pieces within its measured frontier (``row_limit``), as the op a
        compiled graph calls: xb [T, K] -> [T, N] bfloat16."""
        raise NotImplementedError

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Kernel output ``[T, out]`` bfloat16 -> ``dtype``, plus the bias."""
        y = y.to(dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
