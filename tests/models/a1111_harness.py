"""AUTOMATIC1111's own LoRA loading code (extensions-builtin/Lora), run without the webui: the
folder `pytest --a1111=PATH` names; without it the tests that need it are skipped, saying so.
Third-party code (AGPL-3 webui, Stability-AI's ldm / sgm) is never committed here.

PATH has the layout of a webui checkout whose `repositories/` were cloned by its first launch,
so such a checkout can be named as it is; `python -m tests.models.a1111_harness assemble`
builds the same layout from the few files needed (docs/lora_tools.md says how):

    extensions-builtin/Lora/{networks,network,network_*,lyco_helpers}.py   A1111's loader
    modules/textual_inversion/textual_inversion.py                         its embedding loader
    configs/v1-inference.yaml                                              A1111's SD 1.x config
    repositories/stable-diffusion-stability-ai/{ldm/, configs/stable-diffusion/v2-inference.yaml}
    repositories/generative-models/{sgm/, configs/inference/sd_xl_base.yaml}

A1111's loader imports the webui's own package, also named `modules`, as Tempera's engine is.
`import_a1111` therefore imports the loader with the smallest stand-ins of the webui modules it
names (`shared`, `devices`, `sd_models`, ...: settings, the loaded model, file reading) in
`sys.modules` for the length of that import only, and puts Tempera's `modules` back at once;
A1111's functions keep the stand-ins they imported. Everything A1111 computes (key conversion,
matching keys to the webui model's layers, the network module types and their `calc_updown`)
is A1111's code. Its `lora_patches` (which patches torch layers when the webui starts) and
`lora_logger` are stand-ins too: nothing in loading a file runs them.

`import_a1111_textual_inversion` imports the webui's `modules/textual_inversion/
textual_inversion.py` (`EmbeddingDatabase`, `create_embedding_from_data`, `Embedding`) the same
way, as `modules.textual_inversion.textual_inversion`, with stand-ins for the webui modules it
names (`shared` with the model the test sets, `devices`, `hashes`, `errors` that raise, and
empty ones for the training and image code it imports but loading never runs).

sgm's package `__init__`s import its whole training stack (pytorch-lightning, kornia, open_clip
encoders ...); `import_sgm_unet` imports sgm's UNet module alone, giving its packages empty
namespace modules instead of running those `__init__`s.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.stand_ins import torchvision_stand_in

LORA_DIR = Path("extensions-builtin") / "Lora"
LORA_FILES = ("networks.py", "network.py", "network_lora.py", "network_hada.py",
              "network_lokr.py", "network_ia3.py", "network_full.py", "network_norm.py",
              "network_glora.py", "network_oft.py", "lyco_helpers.py")
TI_FILE = Path("modules") / "textual_inversion" / "textual_inversion.py"
LDM_REPO = Path("repositories") / "stable-diffusion-stability-ai"
SGM_REPO = Path("repositories") / "generative-models"
# the yaml each webui model is built from, as A1111's sd_models_config picks it
CONFIGS = {"sd15": Path("configs") / "v1-inference.yaml",
           "sd2": LDM_REPO / "configs" / "stable-diffusion" / "v2-inference.yaml",
           "sdxl": SGM_REPO / "configs" / "inference" / "sd_xl_base.yaml"}
# the commits A1111 v1.10 pins for its repositories (modules/launch_utils.py)
PINNED = {"stable-diffusion-stability-ai": "cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf",
          "generative-models": "45c443b316737a4ab6e40413d7794a7f5657c19f"}
NEEDED_PACKAGES = ("einops", "open_clip", "yaml")


def missing_files(root: Path) -> list[str]:
    """The files of the harness layout that `root` lacks."""
    wanted = [LORA_DIR / f for f in LORA_FILES] + list(CONFIGS.values()) + [
        LDM_REPO / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py",
        SGM_REPO / "sgm" / "modules" / "diffusionmodules" / "openaimodel.py"]
    return [str(p) for p in wanted if not (root / p).is_file()]


def assemble(webui: Path, stablediffusion: Path, generative_models: Path, dest: Path) -> Path:
    """Copy the files the harness runs from checkouts of the three repositories into `dest`
    (the layout above); fails naming every file a checkout lacks."""
    plan = [(webui / LORA_DIR / f, dest / LORA_DIR / f) for f in LORA_FILES]
    plan.append((webui / TI_FILE, dest / TI_FILE))
    plan += [(webui / CONFIGS["sd15"], dest / CONFIGS["sd15"]),
             (stablediffusion / "ldm", dest / LDM_REPO / "ldm"),
             (stablediffusion / "configs" / "stable-diffusion" / "v2-inference.yaml",
              dest / CONFIGS["sd2"]),
             (generative_models / "sgm", dest / SGM_REPO / "sgm"),
             (generative_models / "configs" / "inference" / "sd_xl_base.yaml",
              dest / CONFIGS["sdxl"])]
    lacking = [str(src) for src, _ in plan if not src.exists()]
    if lacking:
        raise SystemExit("not found (is each path a checkout of its repository?):\n  "
                         + "\n  ".join(lacking))
    for src, target in plan:
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)
    return dest


class _WebuiModules:
    """The webui modules A1111's LoRA loader imports, as the smallest stand-ins: settings at
    their defaults, `shared.sd_model` (set by the tests), safetensors reading, CPU float32."""

    def __init__(self, lora_dir: str) -> None:
        self.modules: dict[str, types.ModuleType] = {}
        shared = self._module("modules.shared", sd_model=None, walk_files=_no_files,
                              opts=types.SimpleNamespace(
                                  lora_preferred_name="Alias from file", lora_functional=False,
                                  lora_in_memory_limit=0, lora_bundled_ti_to_infotext=True,
                                  lora_not_found_warning_console=False,
                                  lora_not_found_gradio_warning=False),
                              cmd_opts=types.SimpleNamespace(lora_dir=lora_dir,
                                                             lyco_dir_backcompat=lora_dir))
        self.shared = shared
        cpu = torch.device("cpu")
        self._module("modules.devices", cpu=cpu, device=cpu, dtype=torch.float32,
                     torch_gc=lambda: None, cond_cast_unet=lambda x: x)
        self._module("modules.sd_models", read_state_dict=_read_state_dict,
                     read_metadata_from_safetensors=_read_metadata)
        self._module("modules.cache",
                     cached_data_for_file=lambda subsection, title, filename, func: func())
        self._module("modules.hashes", sha256_from_cache=lambda *a, **k: None,
                     sha256=lambda *a, **k: None)
        self._module("modules.errors", display=_reraise, report=_reraise)
        self._module("modules.scripts")
        self._module("modules.sd_hijack")
        self._module("modules.textual_inversion")
        self._module("modules.textual_inversion.textual_inversion",
                     create_embedding_from_data=_no_bundled_embeddings)
        self._module("modules.models")
        self._module("modules.models.sd3")
        # A1111's SD3 fused q/k/v layer: a Linear subclass no SD 1/2/XL layer is
        self._module("modules.models.sd3.mmdit",
                     QkvLinear=type("QkvLinear", (torch.nn.Linear,), {}))
        self._module("gradio", Warning=lambda message: None)
        self._module("lora_patches", LoraPatches=type("LoraPatches", (), {}))
        self._module("lora_logger", logger=logging.getLogger("a1111.lora"))

    def _module(self, name: str, **attrs: Any) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so `import modules.x.y` finds its children here
        module.__dict__.update(attrs)
        parts = name.rsplit(".", 1)
        if len(parts) == 2:
            parent = self.modules.get(parts[0]) or self._module(parts[0])
            setattr(parent, parts[1], module)
        self.modules[name] = module
        return module


class _WebuiTextualInversionModules(_WebuiModules):
    """The webui modules `textual_inversion.py` imports: `shared` (settings at their defaults,
    `sd_model` set by the tests), `devices` (CPU), `hashes` (no cache: no hash), `errors`
    (raise); the training, dataset and image-embedding modules it names only for training and
    for embeddings stored in PNGs, which loading a safetensors file never calls."""

    def __init__(self) -> None:
        self.modules = {}
        self.shared = self._module(
            "modules.shared", sd_model=None,
            opts=types.SimpleNamespace(textual_inversion_print_at_load=False,
                                       save_optimizer_state=False),
            cmd_opts=types.SimpleNamespace())
        cpu = torch.device("cpu")
        self._module("modules.devices", cpu=cpu, device=cpu, dtype=torch.float32,
                     torch_npu_set_device=lambda: None)
        self._module("modules.hashes", sha256=lambda *a, **k: None)
        self._module("modules.errors", report=_reraise, display=_reraise)
        for name in ("sd_hijack", "sd_models", "images", "sd_samplers", "sd_hijack_checkpoint",
                     "textual_inversion.dataset"):
            self._module(f"modules.{name}")
        self._module("modules.textual_inversion.learn_schedule",
                     LearnRateScheduler=type("LearnRateScheduler", (), {}))
        self._module("modules.textual_inversion.image_embedding", **{
            name: _not_in_harness(name) for name in (
                "embedding_to_b64", "embedding_from_b64", "insert_image_data_embed",
                "extract_image_data_embed", "caption_image_overlay")})
        self._module("modules.textual_inversion.saving_settings",
                     save_settings_to_file=_not_in_harness("save_settings_to_file"))


def _not_in_harness(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"A1111 called {name}, which this harness does not run")
    return refuse


def _no_files(path: str, allowed_extensions: list[str] | None = None) -> Iterator[str]:
    return iter(())


def _read_state_dict(filename: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(filename)


def _read_metadata(filename: str) -> dict[str, str]:
    from safetensors import safe_open
    with safe_open(filename, "pt") as f:
        return dict(f.metadata() or {})


def _reraise(error: BaseException | str, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(f"A1111 reported an error: {error}")


def _no_bundled_embeddings(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the file bundles textual-inversion embeddings (bundle_emb.*), "
                         "which this harness does not load")


@contextlib.contextmanager
def _webui_modules_in_place(stand_ins: dict[str, types.ModuleType]) -> Iterator[None]:
    """Tempera's `modules` out of sys.modules and the webui stand-ins in, then back."""
    ours = {n: m for n, m in sys.modules.items() if n == "modules" or n.startswith("modules.")}
    for name in ours:
        del sys.modules[name]
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "modules" or n.startswith("modules.")]:
            del sys.modules[name]
        sys.modules.update(ours)


def import_open_clip() -> types.ModuleType:
    """open_clip (pip install open_clip_torch --no-deps), imported with a torchvision stand-in
    that only its import sees."""
    pytest.importorskip("ftfy", reason="open_clip needs ftfy (pip install ftfy)")
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    with torchvision_stand_in():
        import open_clip
    return open_clip


def import_sgm_unet(root: Path) -> types.ModuleType:
    """sgm.modules.diffusionmodules.openaimodel from `root`'s generative-models, without the
    package `__init__`s (see the module docstring)."""
    sgm = root / SGM_REPO / "sgm"
    for name, folder in (("sgm", sgm), ("sgm.modules", sgm / "modules"),
                         ("sgm.modules.diffusionmodules", sgm / "modules" / "diffusionmodules")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
    return importlib.import_module("sgm.modules.diffusionmodules.openaimodel")


def import_ldm_unet(root: Path) -> types.ModuleType:
    """ldm.modules.diffusionmodules.openaimodel from `root`'s stable-diffusion-stability-ai."""
    path = str(root / LDM_REPO)
    if path not in sys.path:
        sys.path.append(path)
    return importlib.import_module("ldm.modules.diffusionmodules.openaimodel")


def import_a1111(root: Path) -> types.SimpleNamespace:
    """A1111's `networks` (its LoRA loader) and the webui stand-ins it reads, plus ldm's and
    sgm's UNet modules and open_clip, from the harness folder `root` (skips, naming what is
    missing, when the folder or a package is not there)."""
    lacking = missing_files(root)
    if lacking:
        pytest.skip(f"{root}: not an A1111 harness folder (missing {', '.join(lacking[:3])}"
                    f"{' ...' if len(lacking) > 3 else ''}; docs/lora_tools.md says how to "
                    "assemble one)")
    for package in NEEDED_PACKAGES:  # found, not imported: open_clip needs its stand-in
        if importlib.util.find_spec(package) is None:
            pip = {"open_clip": "open_clip_torch --no-deps ftfy", "yaml": "pyyaml"}.get(package,
                                                                                     package)
            pytest.skip(f"the A1111 harness needs {package} (pip install {pip})")
    open_clip = import_open_clip()
    lora_dir = str(root / LORA_DIR)
    webui = _WebuiModules(tempfile.mkdtemp(prefix="a1111-lora-dir-"))
    sys.path.insert(0, lora_dir)
    try:
        with _webui_modules_in_place(webui.modules):
            networks = importlib.import_module("networks")
    finally:
        sys.path.remove(lora_dir)
    if Path(networks.__file__).resolve().parent != Path(lora_dir).resolve():
        raise RuntimeError(f"imported {networks.__file__}, not the harness's networks.py")
    return types.SimpleNamespace(
        networks=networks, network=sys.modules["network"], shared=webui.shared,
        module_types={type(t).__name__: t for t in networks.module_types},
        ldm=import_ldm_unet(root), sgm=import_sgm_unet(root), open_clip=open_clip, root=root)


def import_a1111_textual_inversion(root: Path) -> types.SimpleNamespace:
    """A1111's `modules/textual_inversion/textual_inversion.py` from the harness folder `root`
    and the `shared` stand-in it reads (skips, naming the file, when the folder lacks it)."""
    path = root / TI_FILE
    if not path.is_file():
        pytest.skip(f"{root}: no {TI_FILE} (an A1111 harness folder assembled before it was "
                    "added: run the assemble command of docs/lora_tools.md again)")
    webui = _WebuiTextualInversionModules()
    name = "modules.textual_inversion.textual_inversion"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _webui_modules_in_place(webui.modules):
        spec.loader.exec_module(module)
    return types.SimpleNamespace(textual_inversion=module, shared=webui.shared, root=root)


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.models.a1111_harness assemble --webui ... --out /tmp/a1111`"""
    parser = argparse.ArgumentParser(prog="python -m tests.models.a1111_harness",
                                     description="Assemble the folder `pytest --a1111=PATH` runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("assemble", help="copy the needed files from three checkouts")
    cmd.add_argument("--webui", type=Path, required=True,
                     help="a checkout of AUTOMATIC1111/stable-diffusion-webui (v1.10.x)")
    cmd.add_argument("--stablediffusion", type=Path, default=None,
                     help="a checkout of Stability-AI/stablediffusion at "
                          f"{PINNED['stable-diffusion-stability-ai'][:10]} (default: the "
                          "webui's repositories/stable-diffusion-stability-ai)")
    cmd.add_argument("--generative-models", type=Path, default=None,
                     help="a checkout of Stability-AI/generative-models at "
                          f"{PINNED['generative-models'][:10]} (default: the webui's "
                          "repositories/generative-models)")
    cmd.add_argument("--out", type=Path, required=True, help="the harness folder to write")
    args = parser.parse_args(argv)
    out = assemble(args.webui, args.stablediffusion or args.webui / LDM_REPO,
                   args.generative_models or args.webui / SGM_REPO, args.out)
    print(f"assembled {out}: run pytest --a1111={out}")


if __name__ == "__main__":
    main()
