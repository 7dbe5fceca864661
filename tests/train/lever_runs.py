"""The training runs a memory lever's tests share (tests/train/test_block_offload.py and
test_weight_storage.py): each lever must train, resume exactly and compile REGIONAL AOT_EAGER
with no graph break, so each builds the same three runs with its own overrides."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from modules.config.overrides import apply_overrides
from modules.config.schema import Config
from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.train.test_resume import stop_then_resume

# 2 steps of LoRA on the tiny model at 64 px: wiring, not convergence.
BASE = ("training.max_steps=2", "training.batch_size=2", "training.learning_rate=1e-3",
        "data.resolution=64", "sampling.prompts=[]", "logging.tensorboard=false")
REGIONAL_AOT_EAGER = ("compile.backend=AOT_EAGER", "compile.scope=REGIONAL",
                      "compile.denoiser=true")


def make_config(cache: Path, out: Path, *overrides: str) -> Config:
    return apply_overrides(Config(), [f"general.cache_dir={cache}", f"output.dir={out}",
                                      *BASE, *overrides])


@dataclass
class LeverRuns:
    """Where each run wrote (keys "plain", "resumed", "compiled") and what dynamo counted
    during the compiled run."""
    out: dict[str, Path]
    graph_breaks: dict
    recompiles: dict


def lever_runs(cache: Path, root: Path, lever: Sequence[str], *, plain: Sequence[str] = (),
               compiled: Sequence[str] = ()) -> LeverRuns:
    """Three runs under ``root``: "plain", unbroken with the ``plain`` overrides (the run the
    resumed one must equal); "resumed", with the ``lever`` overrides stopped after step 1 and
    resumed; "compiled", the lever under REGIONAL AOT_EAGER plus ``compiled``'s overrides
    (`train_counting_dynamo`)."""
    out = {name: root / name for name in ("plain", "resumed", "compiled")}
    train(make_config(cache, out["plain"], *plain), RecordingCallbacks())
    stop_then_resume(make_config(cache, out["resumed"], *lever), at=1)
    breaks, recompiles = train_counting_dynamo(
        make_config(cache, out["compiled"], *lever, *REGIONAL_AOT_EAGER, *compiled))
    return LeverRuns(out, breaks, recompiles)


def train_counting_dynamo(config: Config) -> tuple[dict, dict]:
    """Trains ``config`` between a dynamo reset with its counters cleared (so they count this
    run only) and a reset after it (so the next run compiles afresh); returns dynamo's graph
    breaks and recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        train(config, RecordingCallbacks())
        breaks = dict(counters["graph_break"])
        recompiles = dict(counters["recompiles"]) if "recompiles" in counters else {}
    finally:
        torch._dynamo.reset()
    return breaks, recompiles
