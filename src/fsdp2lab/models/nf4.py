"""torchao's NF4 as QLoRA's base uses it: the block sizes, the API (one line where torchao lacks
it), and a weight's part quantized into its NF4 shard bit for bit as the whole weight's
(:func:`quantize_into`). ``models/quantize.py`` decides which weights become NF4 and when."""

from __future__ import annotations

import importlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp2lab.errors import UsageError
from fsdp2lab.runtime.torch_compat import local_shape_and_offset, local_tensor, torchao_nf4

BLOCK = 64  # values per absmax block (torchao's to_nf4 default, the QLoRA paper's)
SCALER_BLOCK = 256  # block scales per double-quantization block (torchao's default)
VALUES_PER_SCALER_BLOCK = BLOCK * SCALER_BLOCK  # 16,384: what NF4 quantizes as a whole


def nf4_api():
    """torchao's ``(NF4Tensor, to_nf4)``; UsageError (one line) without a torchao that has them."""
    api = torchao_nf4()
    if isinstance(api, str):
        raise UsageError(api)
    return api


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local part) is a torchao NF4Tensor."""
    if "torchao" not in sys.modules:  # none without torchao imported (nor a search for it)
        return False
    local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
    api = torchao_nf4()
    return not isinstance(api, str) and isinstance(local, api[0])


def quantize_into(target: torch.Tensor, values: torch.Tensor) -> None:
    """Fill ``target``, an NF4 weight or a DTensor of NF4 row shards (its inner tensors as
    ``to_empty`` left them), from ``values``: the part of the whole weight ``target`` holds, in any
    float dtype. Equal, bit for bit, to the same part of ``to_nf4`` of the whole weight: the NF4
    codes and block scales are the part's own (each shard holds whole blocks, :func:`check_sizes`);
    the scales' mean, the one quantity of the whole weight, is taken over the scales of every
    shard, all-gathered over the mesh dimension that shards the rows."""
    nf4_tensor, to_nf4 = nf4_api()
    block_absmax = importlib.import_module(nf4_tensor.__module__).get_block_absmax
    local = local_tensor(target) if isinstance(target, DTensor) else target
    values = values.to(device=local.device, dtype=local.dtype)
    part = to_nf4(values, BLOCK, SCALER_BLOCK)  # its codes; its scales less its own mean
    scales = block_absmax(values.flatten(), BLOCK)
    first = 0
    if isinstance(target, DTensor):
        _, offset = local_shape_and_offset(target)
        first = offset[0] * target.shape[1] // BLOCK
        for dim, placement in enumerate(target.placements):
            if isinstance(placement, Shard):
                group = target.device_mesh.get_group(dim)
                gathered = [torch.empty_like(scales) for _ in range(dist.get_world_size(group))]
                dist.all_gather(gathered, scales, group=group)
                scales = torch.cat(gathered)
    # The whole weight's double quantization of its scales: a block of one scale is its absmax.
    quantized, factors, mean = nf4_tensor.double_quantize_scalers(scales, 1, SCALER_BLOCK)
    count = local.quantized_scalers.numel()
    local.quantized_data.copy_(part.quantized_data)
    local.quantized_scalers.copy_(quantized[first : first + count])
    local.quantization_factor.copy_(
        factors[first // SCALER_BLOCK : (first + count) // SCALER_BLOCK]
    )
    local.scaler_mean = mean  # to_empty leaves the mean and the NF4 levels on the meta device
    local.nf4 = part.nf4
