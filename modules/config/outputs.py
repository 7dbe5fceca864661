"""What a run writes: the `sampling`, `output` and `logging` sections of the config (samples
during training, the saved weights and checkpoints, TensorBoard; docs/sampling.md,
docs/saving.md).

Kept beside `schema.py`, which holds the rest of the tree and names these sections in
`Config`, so the file of each stays readable.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from modules.config.fields import OnResume, setting


class Sampler(str, Enum):
    DDIM = "DDIM"
    EULER = "EULER"
    EULER_A = "EULER_A"
    DPMPP_2M_KARRAS = "DPMPP_2M_KARRAS"
    UNIPC = "UNIPC"


class SaveFormat(str, Enum):
    DIFFUSERS = "DIFFUSERS"
    KOHYA = "KOHYA"
    SINGLE_FILE = "SINGLE_FILE"


class WandbMode(str, Enum):
    ONLINE = "ONLINE"
    OFFLINE = "OFFLINE"


class SaveDType(str, Enum):
    AS_TRAINED = "AS_TRAINED"
    FLOAT32 = "FLOAT32"
    FLOAT16 = "FLOAT16"
    BFLOAT16 = "BFLOAT16"


@dataclass
class SamplingConfig:
    prompts: list[str] = setting(default_factory=lambda: ["a red circle on a blue background"],
                                 label="Prompts", group="Sampling", multiline=True,
                                 help="Prompts sampled during training, one image each. A line "
                                      "may end in kohya's flags: --n negative prompt, --w / --h "
                                      "size, --d seed, --s steps, --l guidance scale "
                                      "(docs/sampling.md).")
    prompts_file: str = setting("", label="Prompts file", group="Sampling", path=True,
                                files=("*.txt",), advanced=True,
                                help="A text file of more prompts, one per line in the same "
                                     "syntax (# starts a comment line); sampled after the "
                                     "prompts above. Empty: none.")
    sampler: Sampler = setting(Sampler.DDIM, label="Sampler", group="Sampling",
                               help="The denoising method samples use (docs/sampling.md).")
    negative_prompt: str = setting("", label="Negative prompt", group="Sampling",
                                   help="What every sample steers away from (a prompt's --n "
                                        "replaces it).")
    every_steps: int = setting(0, label="Sample every N steps", group="Sampling", min=0,
                               max=100_000_000, help="0 samples only at the end of the run.")
    seed: int = setting(42, label="Sampling seed", group="Sampling", min=0, max=2**32 - 1,
                        help="Seed for the sampling noise, so samples are comparable over time.")
    steps: int = setting(20, label="Sampling steps", group="Sampling", min=1, max=1000,
                         help="Denoising steps per sample.")
    guidance_scale: float = setting(7.5, label="Guidance scale", group="Sampling", min=0.0,
                                    max=100.0, help="Classifier-free guidance strength.")


@dataclass
class OutputConfig:
    dir: str = setting("output", label="Output folder", group="General", path=True,
                       on_resume=OnResume.IGNORED,
                       help="Where checkpoints, samples, logs and the run record are written.")
    save_every_steps: int = setting(0, label="Save every N steps", group="General", min=0,
                                    max=100_000_000,
                                    help="Periodic checkpoints; 0 saves only at the end.")
    save_every_epochs: int = setting(
        0, label="Save every N epochs", group="General", min=0, max=1_000_000,
        help="Also save a checkpoint (checkpoints/epoch-NNNNNN/) at the end of every Nth "
             "epoch; 0 = none by epoch. Not at the run's last step (final/ holds it); a step "
             "due by both is saved once, under the epoch name.")
    keep_checkpoints: int = setting(
        0, label="Checkpoints kept", group="General", min=0, max=1_000_000, advanced=True,
        help="Keep only the newest N checkpoints/step-N and epoch-N folders, removing older "
             "ones after each save (across resumed segments); 0 keeps all. final/, backups "
             "and folders of your own are never removed (docs/saving.md).")
    formats: list[SaveFormat] = setting(
        default_factory=lambda: [SaveFormat.DIFFUSERS], label="Save formats", group="General",
        help="DIFFUSERS: LoRA as pytorch_lora_weights.safetensors (diffusers' load_lora_weights), "
             "fine-tune as a diffusers folder. KOHYA (LoRA): lora_kohya.safetensors for ComfyUI "
             "and A1111. SINGLE_FILE (fine-tune): model.safetensors in the original SD layout.")
    overwrite: bool = setting(False, label="Overwrite previous run", group="General",
                              help="Start a new run in an output folder that holds an earlier "
                                   "one: its samples, TensorBoard logs, backups, checkpoints "
                                   "and best/ are removed first (the log and run.json list "
                                   "them); its final/ is replaced when the new run saves. Off "
                                   "refuses to start so nothing is lost. Not applied when "
                                   "resuming: a resume continues the run in the folder.")
    save_dtype: SaveDType = setting(
        SaveDType.AS_TRAINED, label="Save precision", group="General",
        help="The dtype of the saved weights, in every format: AS_TRAINED (LoRA adapters in "
             "float32, full models at the dtype each component was kept at while training), "
             "FLOAT32, FLOAT16 (half the size; what most shared LoRAs use) or BFLOAT16. "
             "Training itself is unchanged (docs/saving.md).")
    backup_every_steps: int = setting(
        0, label="Backup every N steps", group="General", min=0, max=100_000_000, advanced=True,
        help="Write a backup (everything needed to resume exactly: weights, optimizer, LR "
             "schedule, EMA, random states, position in the data) every N steps; 0 = none by "
             "step count. A backup is also written on Stop, on SIGTERM/SIGINT and after a failure.")
    backup_every_minutes: float = setting(
        30.0, label="Backup every N minutes", group="General", min=0.0, max=10_000.0,
        advanced=True, help="Also write a backup when this many minutes passed since the last "
                            "one; 0 = none by time.")
    keep_backups: int = setting(2, label="Backups kept", group="General", min=1, max=1000,
                                advanced=True,
                                help="Older backups beyond this many are removed (docs/resume.md).")


@dataclass
class LoggingConfig:
    tensorboard: bool = setting(True, label="TensorBoard", group="General",
                                help="Write loss, learning rate and samples for TensorBoard.")
    # Weights & Biases (docs/logging.md). The API key is never a setting: wandb reads it from
    # WANDB_API_KEY or its own login (~/.netrc), and a key in a config is refused.
    wandb: bool = setting(False, label="Weights & Biases", group="General",
                          help="Also log the same curves, samples and validation series to "
                               "Weights & Biases (pip install tempera[wandb]); the config and "
                               "run.json are the W&B run's config, and a resumed run continues "
                               "the same W&B run. The API key comes from WANDB_API_KEY or "
                               "`wandb login`, never from the config (docs/logging.md).")
    wandb_project: str = setting("tempera", label="W&B project", group="General", advanced=True,
                                 help="The W&B project the run is logged to (up to 128 "
                                      "characters, none of / \\ # ? % :).")
    wandb_entity: str = setting("", label="W&B entity", group="General", advanced=True,
                                help="The W&B user or team; empty: your default entity.")
    wandb_run_name: str = setting("", label="W&B run name", group="General", advanced=True,
                                  help="The run's display name in W&B; empty: the output "
                                       "folder's name.")
    wandb_mode: WandbMode = setting(
        WandbMode.ONLINE, label="W&B mode", group="General", advanced=True,
        help="ONLINE sends as the run trains (needs an API key and the network). OFFLINE "
             "writes the run under <output>/wandb/ only; upload it later with `wandb sync`.")
