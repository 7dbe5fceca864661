"""`tempera-lora` / `scripts/lora.py`: LoRA tools beside training (docs/lora_tools.md).

    tempera-lora merge --base MODEL --lora a.safetensors:0.8 [--lora b.safetensors] -o OUT
    tempera-lora merge-loras --lora a.safetensors:0.5 --lora b.safetensors:0.5 -o ab.safetensors
    tempera-lora extract --base MODEL --tuned TUNED --rank 16 [--conv-rank 8] -o lora.safetensors
    tempera-lora resize --lora big.safetensors --rank 8 -o small.safetensors
    tempera-lora convert --lora lora.safetensors --layout diffusers -o peft.safetensors

MODEL: a diffusers folder (SD 1.x, 2.x, SDXL or Z-Image's ZImagePipeline), an SD / SDXL
.safetensors checkpoint or Z-Image's ComfyUI diffusion-model .safetensors (its configs from
--config-folder, else the shipped ones), or a built-in tiny model (builtin:tiny-sd15, the
demo's; built into --cache-dir as training builds it). Z-Image: every tool, on the transformer's layers; a
merge's .safetensors output is ComfyUI's diffusion-model file; --layout kohya is the ComfyUI
layout (diffusion_model.<path>), diffusers the peft one ZImagePipeline.load_lora_weights reads.
A LoRA of another family than the base's is refused (docs/lora_tools.md).

Exit codes: 0 done, 2 bad input or an output that cannot be written (the message names the
file or argument; nothing written). resize and extract print each layer to stderr as they go.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modules.model_types import MODEL_TYPES

# How this front end names each input a tool's error names (modules/lora_tools/errors.py)
FLAGS = {"base": "--base", "model_type": "--model-type", "config_folder": "--config-folder",
         "cache_dir": "--cache-dir", "loras": "--lora", "tuned": "--tuned", "rank": "--rank",
         "conv_rank": "--conv-rank", "threshold": "--threshold", "layout": "--layout",
         "output": "--output"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors exit 2 too, with the usage
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def lora_with_weight(text: str) -> tuple[Path, float]:
    """`file.safetensors[:weight]`; the weight must be a finite number."""
    from modules.lora_tools.errors import LoraToolError
    from modules.lora_tools.operations import parse_lora_arg
    try:
        return parse_lora_arg(text)
    except LoraToolError as error:
        raise argparse.ArgumentTypeError(error.text(FLAGS)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="tempera-lora", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def base_args(sub, required: bool) -> None:
        sub.add_argument("--base", required=required,
                         help="the base model: a diffusers folder, an ldm .safetensors file, "
                              "a family's lone diffusion-model file (ComfyUI's) or a builtin: "
                              "model")
        sub.add_argument("--model-type", choices=[t.cli_name for t in MODEL_TYPES],
                         help="the family, when there is no --base (its shipped architecture "
                              "names the layers) or to check the base's")
        sub.add_argument("--config-folder", help="a single-file base's architecture configs "
                                                 "(default: the family's shipped ones)")
        sub.add_argument("--cache-dir", default="",
                         help="where a builtin: model is built (default: the platform's cache "
                              "folder, as training's general.cache_dir)")

    merge = commands.add_parser("merge", help="merge LoRAs into a base model at a weight")
    base_args(merge, True)
    merge.add_argument("--lora", action="append", required=True, type=lora_with_weight,
                       metavar="FILE[:WEIGHT]", help="a LoRA and its weight (default 1)")
    merge.add_argument("-o", "--output", required=True,
                       help="a new folder (diffusers; from a folder base) or a new "
                            ".safetensors (an ldm single file, or the family's lone "
                            "diffusion-model file where it has one; from either base)")

    several = commands.add_parser("merge-loras", help="merge several LoRAs into one (exact)")
    base_args(several, False)
    several.add_argument("--lora", action="append", required=True, type=lora_with_weight,
                         metavar="FILE[:WEIGHT]")
    several.add_argument("--layout", choices=["kohya", "diffusers"], default="kohya")
    several.add_argument("-o", "--output", required=True)

    ext = commands.add_parser("extract", help="a LoRA from the difference of two checkpoints")
    base_args(ext, True)
    ext.add_argument("--tuned", required=True, help="the fine-tuned model (same layout)")
    ext.add_argument("--rank", type=int, required=True)
    ext.add_argument("--conv-rank", type=int, default=0,
                     help="rank of the convolutions' LoRA (LoCon); 0 leaves them out")
    ext.add_argument("--threshold", type=float, default=0.0,
                     help="layers whose largest change is at most this are left out")
    ext.add_argument("--layout", choices=["kohya", "diffusers"], default="kohya")
    ext.add_argument("-o", "--output", required=True)

    res = commands.add_parser("resize", help="lower a LoRA's rank by SVD")
    base_args(res, False)
    res.add_argument("--lora", required=True, type=Path)
    res.add_argument("--rank", type=int, required=True)
    res.add_argument("--layout", choices=["kohya", "diffusers"],
                     help="the output's layout (default: the input's)")
    res.add_argument("-o", "--output", required=True)

    conv = commands.add_parser("convert", help="between the kohya and diffusers/peft layouts")
    base_args(conv, False)
    conv.add_argument("--lora", required=True, type=Path)
    conv.add_argument("--layout", choices=["kohya", "diffusers"], required=True)
    conv.add_argument("-o", "--output", required=True)
    return parser.parse_args(argv)


def run(args: argparse.Namespace):
    """Do what the parsed command says; returns the tool's Report."""
    from modules.lora_tools.operations import run_tool
    lora = getattr(args, "lora", None)  # merge / merge-loras: [(file, weight)]; else one file
    loras = lora if isinstance(lora, list) else [(lora, 1.0)] if lora else []
    return run_tool(args.command, output=args.output, base=args.base,
                    model_type=args.model_type, config_folder=args.config_folder, loras=loras,
                    tuned=getattr(args, "tuned", None), rank=getattr(args, "rank", 0),
                    conv_rank=getattr(args, "conv_rank", 0),
                    threshold=getattr(args, "threshold", 0.0),
                    layout=getattr(args, "layout", None), cache_dir=args.cache_dir,
                    progress=print_progress)


def print_progress(done: int, total: int, what: str) -> None:
    """A layer done (resize, extract): one line on stderr, so stdout holds the report alone."""
    print(f"[{done}/{total}] {what}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from modules.lora_tools.errors import LoraToolError
    from modules.util.library_noise import silence_library_noise
    args = parse_args(argv)
    silence_library_noise()  # warnings about packages we never use (modules/util/library_noise.py)
    try:
        report = run(args)
    except LoraToolError as error:
        print(f"tempera-lora {args.command}: {error.text(FLAGS)}", file=sys.stderr)
        return 2
    print(report.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
