"""Which modules get ``.compile()``d for a component: the whole thing, or its repeated blocks.

REGIONAL scope compiles every block whose class is in `REPEATED_BLOCKS`. Dynamo keys compiled
code on the block class's ``forward`` and (with ``inline_inbuilt_nn_modules``, the default since
torch 2.5) treats parameters as inputs, so blocks of one class with the same shapes share one
graph; blocks with other channel counts add a graph each during the first step.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from modules.config.schema import CompileScope

# component -> class names of the blocks REGIONAL compiles (matched by class name, so neither
# diffusers nor transformers is imported to build the table).
REPEATED_BLOCKS: dict[str, tuple[str, ...]] = {
    "unet": ("BasicTransformerBlock", "ResnetBlock2D"),
    "text_encoder": ("CLIPEncoderLayer",),
    "vae": ("ResnetBlock2D",),
}


def full_targets(component: str, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules FULL scope compiles.

    For the VAE these are ``encoder`` (the training / latent-caching path) and ``decoder``
    (sampling): ``vae.encode``/``vae.decode`` are methods, not modules, and compiling the two
    submodules in place keeps every state-dict key as it was.
    """
    if component != "vae":
        return list(modules)
    targets: list[nn.Module] = []
    for vae in modules:
        parts = [getattr(vae, name, None) for name in ("encoder", "decoder")]
        found = [part for part in parts if isinstance(part, nn.Module)]
        targets.extend(found or [vae])
    return targets


def block_class_name(module: nn.Module) -> str:
    """The class name a block is matched by: its own, or under FSDP2 (whose `fully_shard`
    swaps a module's class for a subclass named FSDP<class>) the class it had before."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(module, FSDPModule):
        return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__
    return type(module).__name__


def regional_targets(component: str, modules: Sequence[nn.Module],
                     blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS) -> list[nn.Module]:
    """Every repeated block of ``component`` (outermost only, in module order)."""
    names = blocks[component]
    targets: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules within an already chosen block
    for root in modules:
        for module in root.modules():
            if block_class_name(module) in names and id(module) not in inside:
                targets.append(module)
                inside.update(id(sub) for sub in module.modules())
    return targets


def compile_targets(component: str, modules: Sequence[nn.Module], scope: CompileScope,
                    blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS,
                    ) -> tuple[list[nn.Module], str | None]:
    """The modules to compile under ``scope``, and why FULL was used if REGIONAL found none."""
    if scope == CompileScope.REGIONAL:
        found = regional_targets(component, modules, blocks)
        if found:
            return found, None
        return (full_targets(component, modules),
                f"REGIONAL found no {' / '.join(blocks[component])} blocks; "
                "compiling the whole component")
    return full_targets(component, modules), None
