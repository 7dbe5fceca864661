"""`tempera-data mask FOLDER`: loss masks for a folder of images (modules/data/prep/masks_job.py).

    tempera-data mask my-dataset --prompt person
    tempera-data mask my-dataset --prompt "the dog" --prompt "the cat" --dilate 8 --blur 2
    tempera-data mask my-dataset --remove-background --background-model u2net_human_seg

Exit status as every `tempera-data` command's (modules/cli/data.py): 0 done (images the model
could not read are named, the job goes on), 2 refused before anything was written (bad options, a folder that is not writable,
a model that is not there offline or is damaged, a folder another job holds), 1 the job failed
part-way (what was written is whole; run it again to continue), 130 stopped by Ctrl+C (run it
again to continue).
"""
from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mask` subcommand's options (the folder and --quiet are modules/cli/data.py's)."""
    from modules.data.prep.segmenters import BACKGROUND_MODELS, DEFAULT_CLIPSEG

    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                      help="what to keep, for CLIPSeg (e.g. 'person', 'the dog'); repeat it "
                           "to keep several things")
    what.add_argument("--remove-background", action="store_true",
                      help="keep the subject with a background remover (rembg) instead")
    parser.add_argument("--model", default="", metavar="NAME_OR_FOLDER",
                        help=f"CLIPSeg's weights: a Hugging Face repository id or a folder "
                             f"(default {DEFAULT_CLIPSEG})")
    models = ", ".join(f"{m.name} ({m.use})" for m in BACKGROUND_MODELS)
    parser.add_argument("--background-model", default=BACKGROUND_MODELS[0].name,
                        metavar="NAME", help=f"the background remover's model: {models}")
    parser.add_argument("--model-file", type=Path, default=None, metavar="FILE.onnx",
                        help="the background model's .onnx file on disk (of the "
                             "--background-model's kind), instead of rembg's download")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="a pixel at least this likely counts fully, the rest not at all "
                             "(default 0.5)")
    parser.add_argument("--soft", action="store_true",
                        help="no threshold: keep the model's probabilities as grey levels")
    parser.add_argument("--dilate", type=int, default=0, metavar="PIXELS",
                        help="grow what is kept by this many pixels (negative: shrink it)")
    parser.add_argument("--blur", type=float, default=0.0, metavar="RADIUS",
                        help="soften the mask's edge with a Gaussian blur of this radius")
    parser.add_argument("--invert", action="store_true",
                        help="leave out what was found and train on the rest (e.g. "
                             "--prompt watermark --invert)")
    parser.add_argument("--replace", action="store_true",
                        help="replace existing masks (each old one is moved into "
                             ".tempera-mask-backup/ in the folder); without it they are kept")
    parser.add_argument("--recursive", action="store_true",
                        help="the images of subfolders too (kohya's 10_name folders)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="images per forward pass of CLIPSeg (default 4)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the GPU "
                                                       "when there is one)")
    parser.add_argument("--offline", action="store_true",
                        help="never download: a model that is not on disk is refused")


def settings_from(args: argparse.Namespace) -> Any:
    """The job's MaskSettings from the parsed options."""
    from modules.data.prep.mask_ops import MaskShape
    from modules.data.prep.masks_job import MaskSettings

    shape = MaskShape(threshold=None if args.soft else args.threshold, dilate=args.dilate,
                      blur=args.blur, invert=args.invert)
    background = args.remove_background
    return MaskSettings(
        segmenter="background" if background else "clipseg", prompts=tuple(args.prompt),
        model=args.background_model if background else args.model,
        model_file=args.model_file, shape=shape,
        existing="replace" if args.replace else "skip", batch_size=args.batch_size,
        recursive=args.recursive, offline=args.offline, device=args.device)


def run(args: argparse.Namespace, hooks: Any, stop: threading.Event) -> Any:
    """The mask job the options describe (a row of modules/cli/data.py's COMMANDS, which owns
    the progress bar, Ctrl+C and the exit status); returns its JobReport."""
    from modules.data.prep.job import JobRefused
    from modules.data.prep.masks_job import make_masks

    if args.model_file is not None and not args.remove_background:
        raise JobRefused("--model-file is the background remover's (.onnx); for CLIPSeg give "
                         "its folder with --model")
    return make_masks(Path(args.folder), settings_from(args), hooks, stop)
