"""Why a compile bundle starts a new CPU machine slower than the local cache
(docs/benchmarks.md, "Warm starts side by side", (c) against (b)): inductor's precompiled
header of torch's vector code, which it keeps in the temporary folder, not the cache folder.

One real block of the tiny SD 1.5 UNet (aot_probe's, its first BasicTransformerBlock), compiled
with the usual `torch.compile` (inductor) in fresh processes, each timed to the end of one
training step (aot_probe's `run_role`), under these environments, in order:

- ``cold``: an empty inductor cache folder and an empty temporary folder;
- ``warm-same-tmp``: the cache ``cold`` filled, its temporary folder (holding the header);
- ``warm-new-tmp``: the same cache, an empty temporary folder (a new machine with a bundle);
- ``warm-new-tmp-no-header``: as above with the header turned off
  (`TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`): does that skip the header's build?
- ``cold-no-header``: an empty cache and temporary folder, the header off;
- ``cold-O0``: an empty cache and temporary folder, the C++ compiled at -O0 with debug symbols
  (`TORCHINDUCTOR_DEBUG_COMPILE=1`): is the C++ compiler's optimisation the cold cost?

`scripts/probe_compile_header.py` runs it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HEADER_OFF = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
# case -> (cache folder, temporary folder, extra environment): folders by name under the work
# folder, so cases that share one share its contents
CASES: dict[str, tuple[str, str, dict[str, str]]] = {
    "cold": ("cache", "tmp-a", {}),
    "warm-same-tmp": ("cache", "tmp-a", {}),
    "warm-new-tmp": ("cache", "tmp-b", {}),
    "warm-new-tmp-no-header": ("cache", "tmp-c", HEADER_OFF),
    "cold-no-header": ("cache-no-header", "tmp-d", HEADER_OFF),
    "cold-O0": ("cache-O0", "tmp-e", {"TORCHINDUCTOR_DEBUG_COMPILE": "1"}),
}


def case_env(case: str, out: Path) -> dict[str, str]:
    """A case's process environment: its inductor cache folder, its temporary folder (created)
    and its switches, over this process's environment."""
    cache, tmp, extra = CASES[case]
    (out / tmp).mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / cache), "TMPDIR": str(out / tmp),
            **extra}


def measure(out: Path, cache_dir: Path) -> list[dict[str, Any]]:
    """Each case's process, in order: its seconds to the end of one step (or its error)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in CASES:
        done = subprocess.run([sys.executable, "-m", "modules.bench.aot_probe", case,
                               str(out / "block.aot"), "inductor", str(cache_dir),
                               "transformer"],
                              cwd=REPO, env=case_env(case, out), capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"role": case, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    return ("| case | seconds to the end of one step |\n|---|---|\n" + "".join(
        f"| {r['role']} | {r.get('seconds_to_step_end', r.get('error'))} |\n" for r in rows))
