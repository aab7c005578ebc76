"""One autograd Function per adapted linear: the frozen base matmul and its LoRA adapter, fused.

PEFT's ``lora.Linear`` computes ``base(x) + B(A(dropout(x))) * scaling`` as separate ops, with an
elementwise multiply and add over tokens x features in forward and again in backward.
:class:`FusedLoraLinear` runs, for an eligible layer, :class:`LoraLinearFunction`:

* forward: ``y = x W^T (+ bias)``, ``h = x A^T``, ``y.addmm_(h, B^T, alpha=scaling)``;
* backward: ``gx = g W``, ``gh = g B``, ``gB = scaling g^T h``, ``gA = scaling gh^T x`` (``addmm``
  with the scaling as ``alpha``), ``gx.addmm_(gh, A, alpha=scaling)``: no elementwise pass.

The dtypes are PEFT's: under ``torch.autocast`` every matmul runs in the autocast dtype (the
adapters' gradients come back in their own dtype through the casts), else in the input's dtype
(FSDP2's mixed precision gathers base and adapters in one dtype). A layer falls back to PEFT's
forward when it is not eligible: more or other active adapters, dropout, DoRA (any LoRA variant),
a LoRA bias, merged or disabled adapters, ``fan_in_fan_out``, extra forward arguments, a base
that is not ``nn.Linear`` or trains, tensors that are not plain (DTensor under TP; an NF4 base
weight is dequantized with ``weight.to(dtype)``, as torchao's ``linear_nf4`` does), or, without
autocast, adapters in another dtype than the input.

* :func:`fuse` -- make every statically eligible PEFT ``lora.Linear`` of a model a
  :class:`FusedLoraLinear` in place (names, parameters and state dict unchanged).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from peft.tuners.lora import Linear as PeftLinear
from torch._subclasses.fake_tensor import FakeTensor


def _dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as a plain tensor of ``dtype`` (an NF4 weight dequantized)."""
    return weight if _plain(weight) and weight.dtype == dtype else weight.to(dtype)


class LoraLinearFunction(torch.autograd.Function):
    """``x W^T + bias + scaling (x A^T) B^T`` with a frozen ``W`` and ``bias``; see the module
    docstring. ``x`` is ``[..., in]``; ``A``, ``B`` and ``bias`` are in ``x``'s dtype, ``W`` is
    too or dequantizes to it."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        dense = _dense(weight, x.dtype)
        out = torch.mm(x2, dense.t()) if bias is None else torch.addmm(bias, x2, dense.t())
        h = torch.mm(x2, lora_a.t())
        out.addmm_(h, lora_b.t(), alpha=scaling)
        # An NF4 weight is saved as it is and dequantized again in backward (QLoRA's memory); a
        # plain one in the dtype it ran in, as F.linear under autocast saves it.
        ctx.save_for_backward(x2, dense if _plain(weight) else weight, lora_a, lora_b, h)
        ctx.scaling = scaling
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        gh = torch.mm(g, lora_b)
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, _dense(weight, g.dtype))
            grad_x.addmm_(gh, lora_a, alpha=s)
            grad_x = grad_x.view(*grad.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[3]:
            grad_a = torch.addmm(lora_a, gh.t(), x2, beta=0, alpha=s)
        if ctx.needs_input_grad[4]:
            grad_b = torch.addmm(lora_b, g.t(), h, beta=0, alpha=s)
        return grad_x, None, None, grad_a, grad_b, None


def _plain(*tensors: torch.Tensor | None) -> bool:
    """Whether each tensor is None or a plain tensor (not a subclass: DTensor, NF4Tensor); the
    plan's fake tensors stand for plain ones, so a plan simulates the step that runs."""
    return all(t is None or type(t) in (torch.Tensor, nn.Parameter, FakeTensor) for t in tensors)


@functools.cache
def _nf4_type() -> type | None:
    from fsdp2lab.runtime.torch_compat import torchao_nf4

    api = torchao_nf4()
    return None if isinstance(api, str) else api[0]


class FusedLoraLinear(PeftLinear):
    """PEFT's ``lora.Linear`` whose forward runs :class:`LoraLinearFunction` when it can (see the
    module docstring), else PEFT's own."""

    def _adapter(self) -> str:
        """The name of this layer's one adapter."""
        return next(iter(self.lora_A))

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fused = self._fused_operands(x) if not args and not kwargs else None
        if fused is None:
            return super().forward(x, *args, **kwargs)
        return LoraLinearFunction.apply(*fused, self.scaling[self._adapter()])

    def _fused_operands(self, x: torch.Tensor):
        """``(x, weight, bias, A, B)`` cast as PEFT's path computes them, or None: not eligible
        for this call."""
        if (
            self.disable_adapters
            or self.merged
            or self.active_adapters != [self._adapter()]
            or not isinstance(self.lora_dropout[self._adapter()], nn.Identity)
            or self.lora_variant
        ):
            return None
        base = self.base_layer
        weight, bias = base.weight, base.bias
        lora_a, lora_b = self.lora_A[self._adapter()].weight, self.lora_B[self._adapter()].weight
        nf4 = _nf4_type() if not _plain(weight) else None
        if (
            not _plain(x, bias, lora_a, lora_b)
            or not (_plain(weight) or (nf4 is not None and isinstance(weight, nf4)))
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
        ):
            return None
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        elif all(t is None or t.dtype == x.dtype for t in (bias, lora_a, lora_b)) and (
            nf4 is not None or weight.dtype == x.dtype
        ):
            dtype = x.dtype
        else:  # PEFT's path: a mixed-dtype product, or F.linear's dtype error
            return None
        x, bias, lora_a, lora_b = (
            t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, bias, lora_a, lora_b)
        )
        return x, weight, bias, lora_a, lora_b


def _statically_eligible(module: nn.Module) -> bool:
    return (
        type(module) is PeftLinear
        and isinstance(module.base_layer, nn.Linear)
        and not module.fan_in_fan_out
        and len(module.lora_A) == 1
        and isinstance(module.lora_dropout[next(iter(module.lora_A))], nn.Identity)
        and not module.lora_variant
        and not module.lora_bias[next(iter(module.lora_A))]
    )


def fuse(model: nn.Module) -> list[str]:
    """Make each PEFT ``lora.Linear`` of ``model`` with one adapter, no dropout, no DoRA, no LoRA
    bias and an ``nn.Linear`` base a :class:`FusedLoraLinear` (in place); their names."""
    fused = []
    for name, module in model.named_modules():
        if _statically_eligible(module):
            module.__class__ = FusedLoraLinear
            fused.append(name)
    return fused
