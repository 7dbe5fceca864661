"""The latent caching pass of a run on the CPU encodes a 16-bit VAE at float32 (16-bit
convolutions are about 15 times slower there) and leaves its weights as they were."""
from __future__ import annotations

import pytest
import torch

from modules.train.recipe.latents import at_float32, encodes_upcast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_vae_encodes_at_float32_on_the_cpu_only(dtype):
    assert encodes_upcast(dtype, torch.device("cpu"))
    assert not encodes_upcast(dtype, torch.device("cuda"))
    assert not encodes_upcast(torch.float32, torch.device("cpu"))


def test_the_weights_come_back_at_their_own_dtype_bit_for_bit_even_after_an_error():
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    module[0].to(torch.bfloat16)   # mixed dtypes: each tensor returns to its own
    before = {name: t.clone() for name, t in module.state_dict().items()}
    with pytest.raises(RuntimeError, match="inside"):
        with at_float32(module):
            assert all(t.dtype == torch.float32 for t in module.state_dict().values()
                       if t.is_floating_point())
            raise RuntimeError("inside")
    after = module.state_dict()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
