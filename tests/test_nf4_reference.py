"""torchao's NF4 (what ``--quantize-base nf4`` stores) against a NumPy reference written from the
QLoRA paper and the scheme's description, not from torchao's code paths.

The reference: the 16 NF4 levels of Dettmers et al. 2023 (QLoRA), Appendix E; blocks of 64
values scaled by their absmax, each value stored as the index of its nearest level, two indices a
byte (the first in the high nibble); the block scales double-quantized: less their mean over the
whole tensor, in groups of 256 scaled to int8 by 256 / (2 x the group's absmax), rounded half to
even and clipped to [-128, 127]; dequantized as level x (int8 / factor + mean).

torchao keeps the paper's levels to 4 decimals (checked below), so the reference uses those. The
mean is a float32 sum whose order is torch's: the reference's is within a few ulps of torchao's,
and everything after it, given torchao's mean, is equal bit for bit: the int8 scales, their
factors, the packed indices and the dequantized weights, on random weights and on a tiny gpt's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from fsdp2lab.config import TrainConfig
from fsdp2lab.models import get_spec
from fsdp2lab.models.quantize import BLOCK, SCALER_BLOCK

pytestmark = [pytest.mark.hf]  # the hf stage installs the qlora extra
pytest.importorskip("torchao")
from fsdp2lab.runtime.torch_compat import torchao_nf4  # noqa: E402

NF4Tensor, to_nf4 = torchao_nf4()

# QLoRA (Dettmers et al. 2023), Appendix E: the NF4 data type's 16 values.
PAPER_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip
LEVELS = np.round(PAPER_LEVELS, 4).astype(np.float32)  # torchao's table


def block_absmax(weight: np.ndarray) -> np.ndarray:
    return np.abs(weight.reshape(-1, BLOCK)).max(axis=1)


def reference_mean(weight: np.ndarray) -> np.float32:
    """The block scales' mean, summed exactly (float64) and rounded to float32."""
    return np.float32(block_absmax(weight).astype(np.float64).mean())


def reference_nf4(weight: np.ndarray, mean: np.float32) -> dict[str, np.ndarray]:
    """NF4 of a float32 ``weight`` with scale mean ``mean``: packed indices, int8 scales, their
    factors, and the dequantized weight."""
    blocks = weight.reshape(-1, BLOCK)
    absmax = block_absmax(weight)
    centred = (absmax - mean).reshape(-1, SCALER_BLOCK)
    factor = np.float32(256) / (np.float32(2) * np.abs(centred).max(axis=1))
    scales_q = np.clip(np.round(centred * factor[:, None]), -128, 127).astype(np.int8)
    scales = (scales_q.astype(np.float32) / factor[:, None]).reshape(-1) + mean
    index = np.abs((blocks / absmax[:, None])[..., None] - LEVELS).argmin(axis=-1)
    flat = index.reshape(-1).astype(np.uint8)
    return {
        "quantized_data": (flat[::2] << 4) | flat[1::2],
        "quantized_scalers": scales_q.reshape(-1),
        "quantization_factor": factor,
        "dequantized": (LEVELS[index] * scales[:, None]).reshape(weight.shape),
    }


def assert_matches_reference(weight: torch.Tensor) -> None:
    nf4 = to_nf4(weight, BLOCK, SCALER_BLOCK)
    w = weight.numpy()
    ao_mean = np.float32(nf4.scaler_mean.item())
    assert abs(reference_mean(w) - ao_mean) <= 4 * np.spacing(ao_mean)
    expected = reference_nf4(w, ao_mean)
    got = {name: getattr(nf4, name).numpy() for name in expected if name != "dequantized"}
    got["dequantized"] = nf4.get_original_weight().numpy()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_torchao_levels_are_the_papers_to_4_decimals():
    nf4 = to_nf4(torch.randn(128, 128))
    np.testing.assert_array_equal(nf4.nf4.numpy(), LEVELS)
    assert np.abs(LEVELS - PAPER_LEVELS).max() <= 5e-5


@pytest.mark.parametrize(
    ("rows", "cols", "scale"), [(128, 128, 0.02), (512, 96, 1.0), (64, 1024, 30.0)]
)
def test_random_weights_match_the_reference(rows, cols, scale):
    generator = torch.Generator().manual_seed(rows + cols)
    weight = torch.randn(rows, cols, generator=generator) * scale
    weight[0, :5] *= 40  # outliers: the blocks' absmax and the scale groups' ranges differ
    assert_matches_reference(weight)


def test_a_tiny_gpts_layer_weights_match_the_reference():
    cfg = TrainConfig(model="gpt", d_model=128, n_layers=2, n_heads=4, seq_len=16)
    torch.manual_seed(0)
    model = get_spec("gpt", cfg).build(cfg)
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 12
    for linear in linears:
        assert_matches_reference(linear.weight.detach())
