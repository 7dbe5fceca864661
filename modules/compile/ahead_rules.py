"""When ``compile.ahead`` can run (docs/compilation.md): the config's own rules for it, which
need the backends' table (so they live here, above the config, and the front ends' check and
the trainer's preparation add them to `validate`'s problems)."""
from __future__ import annotations

from modules.compile.backends import BACKENDS
from modules.config import Problem
from modules.config.schema import Config, Device


def ahead_problems(config: Config) -> list[Problem]:
    """compile.ahead writes a compile bundle in a process of its own (docs/compilation.md):
    only where there is an inductor cache to write and a bundle to carry it, on the CPU."""
    c = config.compile
    if not c.ahead:
        return []
    given = "true"
    if not BACKENDS[c.backend].compiles:
        return [Problem("compile.ahead", "false with compile.backend=NONE", given,
                        "nothing is compiled, so there is nothing to compile ahead")]
    if not BACKENDS[c.backend].inductor:
        return [Problem("compile.ahead", "an inductor backend (DEFAULT, INDUCTOR, TRITON)",
                        f"true with compile.backend={c.backend.value}",
                        "only inductor writes the cache artifacts a compile bundle carries")]
    if not (c.denoiser or c.text_encoder or c.vae):
        return [Problem("compile.ahead", "a compiled component", given,
                        "compile.denoiser, compile.text_encoder and compile.vae are all off")]
    if not c.bundles:
        return [Problem("compile.ahead", "compile.bundles=true", given,
                        "the process that compiles ahead hands its work to the run as a "
                        "compile bundle; turn compile.bundles on")]
    if config.general.device == Device.CUDA:
        return [Problem("compile.ahead", "general.device CPU or AUTO", "true with CUDA",
                        "compiling for the GPU in another process needs a second copy of the "
                        "weights on the GPU (fake and meta tensors give inductor no code to "
                        "cache); the run compiles at step 1 there")]
    return []

