"""Issue 55 item 3: can torch's ahead-of-time compile carry a REGIONAL block, forward and
backward, so that a new process skips dynamo's tracing too, with the step's numbers unchanged?

One real block of the tiny SD 1.5 UNet (its first `BasicTransformerBlock`: self- and
cross-attention, feed-forward, the class REGIONAL compiles) is compiled whole-graph
(`torch.compile(block, fullgraph=True)`) in five fresh processes, each timed to the end of one
training step (forward, loss, backward):

- ``aot-save``: ahead-of-time (`OptimizedModule._aot_compile`, torch 2.13's experimental
  module path, `torch._dynamo.config.enable_aot_compile`), saved to a file;
- ``aot-load-cold`` / ``aot-load-warm``: that file loaded into a new copy of the block
  (`_load_aot_compiled_module`), with an empty inductor cache, then with the cache the first
  load filled;
- ``normal-cold`` / ``normal-warm``: the usual `torch.compile`, empty cache then warm (what a
  compile bundle gives a new machine: the cache entries, not the tracing).

Every process's loss and gradients are compared with the saving process's, bit for bit.
`scripts/probe_aot_compile.py` runs it; docs/compilation.md has what it found.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROLES = ("aot-save", "aot-load-cold", "aot-load-warm", "normal-cold", "normal-warm")
REPO = Path(__file__).resolve().parents[2]


BLOCKS = ("transformer", "mlp")


def _block_and_inputs(kind: str, cache_dir: Path) -> tuple[Any, tuple, dict]:
    """``transformer``: the tiny SD 1.5 UNet's first BasicTransformerBlock (what REGIONAL
    compiles); ``mlp``: Linear, GELU, Linear, a block with nothing but tensor code."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch import nn

    if kind == "mlp":
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        return mlp, (x,), {}

    from modules.model_types import BUILTIN_DEMO
    from modules.models.tiny import ensure_builtin_model

    folder = ensure_builtin_model(BUILTIN_DEMO, cache_dir)  # the tiny SD 1.5 UNet
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    block.train()
    width = block.norm1.normalized_shape[0]
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 64, width, generator=gen, requires_grad=True)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, generator=gen)
    return block, (hidden,), {"encoder_hidden_states": context}


def run_role(role: str, artifact: Path, backend: str, cache_dir: Path, kind: str
             ) -> dict[str, Any]:
    """One process's part (see the module docstring): its seconds to the end of the step,
    and the step's loss and gradients (saved beside the artifact by ``aot-save``)."""
    import torch
    import torch._dynamo
    from torch._dynamo.aot_compile import ModelInput

    torch._dynamo.config.enable_aot_compile = True
    block, args, kwargs = _block_and_inputs(kind, cache_dir)
    started = time.perf_counter()
    compiled: Any = torch.compile(block, fullgraph=True, backend=backend)
    if role == "aot-save":
        compiled._aot_compile([ModelInput(args=args, kwargs=kwargs, contexts=[])])
        artifact.write_bytes(compiled._save_aot_compiled_module())
    elif role.startswith("aot-load"):
        compiled._load_aot_compiled_module(artifact.read_bytes())
    loss = compiled(*args, **kwargs).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    step = [loss.detach(), args[0].grad, *(p.grad for p in block.parameters())]
    reference = artifact.with_suffix(".step")
    if role == "aot-save":
        torch.save(step, reference)
    same = (all(torch.equal(a, b) for a, b in zip(step, torch.load(reference)))
            if reference.is_file() else None)  # None: nothing was saved to compare with
    return {"role": role, "seconds_to_step_end": round(seconds, 2),
            "artifact_bytes": artifact.stat().st_size if role.startswith("aot") else None,
            "same_as_saved": same}


def measure(out: Path, backend: str = "inductor", kind: str = "transformer",
            cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """The five processes, in order; each one's result (or its error)."""
    from modules.paths import cache_dir_for

    out.mkdir(parents=True, exist_ok=True)
    models = cache_dir or cache_dir_for("")
    rows = []
    for role in ROLES:
        # a process's inductor cache: the loads share one (cold, then warm), so do the normal
        # compiles; the saving process has its own, so no load starts from its kernels
        cache = out / ("cache-save" if role == "aot-save" else
                       "cache-load" if role.startswith("aot-load") else "cache-normal")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        done = subprocess.run([sys.executable, "-m", "modules.bench.aot_probe", role,
                               str(out / "block.aot"), backend, str(models), kind],
                              cwd=REPO, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"role": role, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
    return rows


def markdown(rows: list[dict[str, Any]], backend: str, kind: str) -> str:
    head = (f"| {kind} block, {backend} | seconds to the end of one step | artifact bytes | step equal to "
            "the saving process's |\n|---|---|---|---|\n")
    return head + "".join(
        f"| {r['role']} | {r.get('seconds_to_step_end', r.get('error'))} | "
        f"{r.get('artifact_bytes') or ''} | {r.get('same_as_saved', '')} |\n" for r in rows)


if __name__ == "__main__":
    role, artifact, backend, models, kind = sys.argv[1:6]
    print(json.dumps(run_role(role, Path(artifact), backend, Path(models), kind)))
