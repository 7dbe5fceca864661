"""Fixtures for the compile engine tests: a tiny UNet, a repeatable training loop, test backends."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

FAIL_COMPILE = "tempera_test_fail_compile"
FAIL_BACKWARD = "tempera_test_fail_backward"


def for_training(unet: torch.nn.Module, lora: bool, checkpointing: bool) -> torch.nn.Module:
    """``unet`` in training mode, with a LoRA on its attention projections (the base frozen)
    and gradient checkpointing as asked."""
    if lora:
        from peft import LoraConfig

        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return unet


def build_tiny_unet(lora: bool = False, checkpointing: bool = False) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        norm_num_groups=8, sample_size=8, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return for_training(unet, lora, checkpointing)


def train_losses(unet: torch.nn.Module, engine=None, steps: int = 3,
                 sizes: tuple[int, ...] = (8,), accumulation: int = 1) -> list[float]:
    """A few SGD steps; noise and timesteps are drawn outside the guarded micro-steps, and each
    optimizer step's micro-steps run in one of ``engine``'s guarded windows."""
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    for step in range(steps):
        size = sizes[step % len(sizes)]
        window = engine.window() if engine is not None else None
        results = []
        for _ in range(accumulation):
            latents = torch.randn(2, 4, size, size, generator=gen)
            noise = torch.randn(2, 4, size, size, generator=gen)
            timesteps = torch.randint(0, 1000, (2,), generator=gen)
            text = torch.randn(2, 7, 32, generator=gen)

            def micro_step(latents=latents, noise=noise, timesteps=timesteps, text=text):
                pred = unet(latents + noise, timesteps, text).sample
                loss = F.mse_loss(pred, noise) / accumulation
                loss.backward()
                return loss.detach()

            if window is None:
                results.append(micro_step())
            else:
                window.run(micro_step)
        losses.extend(float(x) for x in (window.results if window is not None else results))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _fail_compile(gm, example_inputs):
    raise RuntimeError("tempera test backend refuses to compile\nsecond line")


def _fail_backward(gm, example_inputs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def bw_compiler(bw_gm, bw_inputs):
        def broken(*args):
            raise RuntimeError("tempera test backend: compiled backward failed")
        return make_boxed_func(broken)

    return aot_autograd(fw_compiler=lambda fw_gm, _: make_boxed_func(fw_gm.forward),
                        bw_compiler=bw_compiler)(gm, example_inputs)


@pytest.fixture(scope="session")
def failing_backends() -> tuple[str, str]:
    """Dynamo backends that fail at compile time and in the compiled backward (test only)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=None)
    for name, fn in ((FAIL_COMPILE, _fail_compile), (FAIL_BACKWARD, _fail_backward)):
        if name not in known:
            torch._dynamo.register_backend(compiler_fn=fn, name=name)
    return FAIL_COMPILE, FAIL_BACKWARD


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts and ends with no compiled frames (dynamo caches are process-global)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def mlp_step(model: torch.nn.Module, batch: int = 2) -> Callable[[], None]:
    """One micro-step of the Mlp, from clear gradients."""
    model.zero_grad(set_to_none=True)
    return lambda: model(torch.ones(batch, 4)).sum().backward()


@pytest.fixture
def mlp() -> Callable[[], torch.nn.Module]:
    return Mlp


@pytest.fixture
def step() -> Callable[..., Callable[[], None]]:
    return mlp_step


@pytest.fixture
def make_unet() -> Callable[..., torch.nn.Module]:
    return build_tiny_unet


@pytest.fixture
def train() -> Callable[..., list[float]]:
    return train_losses


def build_one_level_unet(lora: bool = False, checkpointing: bool = False) -> torch.nn.Module:
    """The tiny UNet with one level, so no down- or upsampling: a cross-attention down block,
    the mid block and a cross-attention up block, every block at 32 channels (a regional
    compile makes one graph per block class and resolution) and any latent size welcome. Its
    compile costs about a quarter less than build_tiny_unet's; for the engine's and the guard's
    tests, whose properties are not the UNet's layout (the layout's own limits, e.g.
    test_inductor.py's symbolic height and width, keep build_tiny_unet)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32,), layers_per_block=1, cross_attention_dim=32,
        norm_num_groups=8, sample_size=8, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",))
    return for_training(unet, lora, checkpointing)


@pytest.fixture
def make_one_level_unet() -> Callable[..., torch.nn.Module]:
    return build_one_level_unet
