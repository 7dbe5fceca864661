"""The one typed config tree. Each field is declared once, with its default and metadata.

The GUI builds its widgets from this metadata, `--set` overrides walk it, `validate` checks it
and `docs/config.md` is generated from it (`scripts/gen_config_docs.py`). Some sections are
declared in files beside this one and named here: `data` and `validation` (config/data.py),
`loss` (config/loss.py), `sampling`, `output` and `logging` (config/outputs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from modules.config.fields import OnResume, setting
from modules.config.data import DataConfig, DatasetConfig, ValidationConfig  # noqa: F401
from modules.config.loss import (  # noqa: F401 - `loss` section
    HuberSchedule,
    LossConfig,
    LossType,
    TimestepSampling,
)
from modules.config.outputs import (  # noqa: F401 - the sampling, output and logging sections
    LoggingConfig,
    OutputConfig,
    Sampler,
    SamplingConfig,
    SaveDType,
    SaveFormat,
)
from modules.config.textual_inversion import TextualInversionConfig  # noqa: F401
from modules.model_types import (  # noqa: F401 - the config's own names for them
    BUILTIN_PREFIX,
    BUILTIN_DEMO,
    BUILTIN_MODEL_TYPES,
    BUILTIN_SHAPES,
    ModelType,
)

CONFIG_VERSION = 2


class DType(str, Enum):
    FLOAT32 = "FLOAT32"
    FLOAT16 = "FLOAT16"
    BFLOAT16 = "BFLOAT16"


class WeightStorage(str, Enum):
    WEIGHT_DTYPE = "WEIGHT_DTYPE"
    FLOAT8 = "FLOAT8"
    INT8 = "INT8"
    W8A8 = "W8A8"

    @property
    def eight_bit(self) -> bool:
        """Stored in 8 bits (modules/models/weight_storage.py's FORMATS)."""
        return self != WeightStorage.WEIGHT_DTYPE

    @property
    def torchao(self) -> bool:
        """Stored through torchao (FLOAT8, INT8); W8A8 is Tempera's own (models/int8_matmul.py)."""
        return self in (WeightStorage.FLOAT8, WeightStorage.INT8)


class DistributedStrategy(str, Enum):
    DDP = "DDP"
    FSDP = "FSDP"


class PredictionType(str, Enum):
    AUTO = "AUTO"
    EPSILON = "EPSILON"
    V_PREDICTION = "V_PREDICTION"


class TrainingMethod(str, Enum):
    LORA = "LORA"
    FINE_TUNE = "FINE_TUNE"
    TEXTUAL_INVERSION = "TEXTUAL_INVERSION"


class Adapter(str, Enum):
    LORA = "LORA"
    LOCON = "LOCON"
    LOHA = "LOHA"
    LOKR = "LOKR"
    DORA = "DORA"


class Optimizer(str, Enum):
    ADAMW = "ADAMW"
    ADAMW_8BIT = "ADAMW_8BIT"
    PRODIGY = "PRODIGY"
    ADAFACTOR = "ADAFACTOR"
    ADAFACTOR_RELATIVE = "ADAFACTOR_RELATIVE"
    LION = "LION"
    SCHEDULE_FREE_ADAMW = "SCHEDULE_FREE_ADAMW"
    CAME = "CAME"


class LRScheduler(str, Enum):
    CONSTANT = "CONSTANT"
    COSINE = "COSINE"
    LINEAR = "LINEAR"
    COSINE_WITH_RESTARTS = "COSINE_WITH_RESTARTS"
    POLYNOMIAL = "POLYNOMIAL"
    INVERSE_SQRT = "INVERSE_SQRT"


class MixedPrecision(str, Enum):
    NO = "NO"
    FP16 = "FP16"
    BF16 = "BF16"


class CompileBackend(str, Enum):
    NONE = "NONE"
    DEFAULT = "DEFAULT"
    INDUCTOR = "INDUCTOR"
    TRITON = "TRITON"
    AOT_EAGER = "AOT_EAGER"


class CompileScope(str, Enum):
    FULL = "FULL"
    REGIONAL = "REGIONAL"
    AUTO = "AUTO"


class CompileMode(str, Enum):
    DEFAULT = "DEFAULT"
    REDUCE_OVERHEAD = "REDUCE_OVERHEAD"
    MAX_AUTOTUNE = "MAX_AUTOTUNE"
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "MAX_AUTOTUNE_NO_CUDAGRAPHS"


class DynamicShapes(str, Enum):
    DYNAMIC = "DYNAMIC"
    AUTO = "AUTO"
    STATIC = "STATIC"


class Device(str, Enum):
    AUTO = "AUTO"
    CPU = "CPU"
    CUDA = "CUDA"


@dataclass
class GeneralConfig:
    device: Device = setting(Device.AUTO, label="Device", compile_check=True, group="General",
                             help="Where to train. AUTO picks CUDA when a GPU is visible, else the CPU.")
    cache_dir: str = setting("", label="Cache folder", group="General", path=True, advanced=True,
                             help="Where built-in models, datasets, latent caches and (unless "
                                  "Compile cache folder is set) the compile cache are kept. "
                                  "Empty means ~/.cache/tempera.")
    # issue 46 item 5: a preset says which card it is for and why each setting was chosen
    description: str = setting("", label="Description", group="General", multiline=True,
                               advanced=True, on_resume=OnResume.IGNORED, compile_check=False,
                               help="What this config is for and why its settings were "
                                    "chosen (a preset names the card it fits). Training does "
                                    "not read it.")


@dataclass
class ModelConfig:
    path: str = setting(BUILTIN_DEMO, label="Base model", group="Model", path=True,
                        files=("*.safetensors", "*.ckpt", "*.pt", "*.bin"),
                        help="A diffusers model folder, a single-file checkpoint in the original "
                             "SD/SDXL layout (.safetensors), or a built-in model such as "
                             f"'{BUILTIN_DEMO}' (a tiny random-weight model built locally).")
    type: ModelType = setting(BUILTIN_MODEL_TYPES[BUILTIN_DEMO], label="Model type", group="Model",
                              help="The model family: decides which components exist and how "
                                   "they are conditioned.")
    weight_dtype: DType = setting(DType.FLOAT32, label="Frozen weights dtype", group="Model",
                                  help="Data type of the weights that are not trained.")
    weight_storage: WeightStorage = setting(
        WeightStorage.WEIGHT_DTYPE, label="Frozen weights storage", group="Model",
        help="How the frozen weights of the denoiser and text encoders are kept on the device. "
             "WEIGHT_DTYPE: at model.weight_dtype. FLOAT8: their linear layers stored as float8 "
             "e4m3 with one scale per output row (torchao: pip install torchao) and turned "
             "back into model.weight_dtype inside each layer's forward (inside a compiled "
             "block's graph): about half the bytes of bfloat16, at a small cost in quality. "
             "INT8: the same with int8 values, one scale and zero point per row: the same "
             "saving, for cards without float8 (RTX 30 series and older). "
             "W8A8: the denoiser's linear layers stored as INT8 stores them (one scale per "
             "row, no zero point) and multiplied in int8: each layer's input quantized to "
             "int8 per token, int8 x int8 matmuls (torch._int_mm), for speed on cards with "
             "int8 tensor cores (sm_80 or newer: RTX 30, A100; refused on a device without "
             "int8 kernels); the text encoders stay at model.weight_dtype; not with DORA. "
             "LoRA only (trained weights are never stored in 8 bits); convolutions, norms, "
             "embeddings and the VAE stay at model.weight_dtype. docs/memory.md has what it "
             "saves and costs.")
    offload_blocks: int = setting(
        0, label="Offloaded blocks", group="Model", min=0, max=10_000, advanced=True,
        help="How many of the denoiser's repeated blocks (the UNet's transformer and resnet "
             "blocks, Z-Image's transformer layers: the ones REGIONAL compile compiles) are "
             "kept in CPU memory (pinned on CUDA) and streamed to the device just ahead of "
             "their use, forward and backward, on a side CUDA stream; the largest blocks go "
             "first. 0 is off. Saves the device memory of those blocks' frozen weights, less "
             "the two blocks in flight at a time; costs the PCIe transfer of every offloaded "
             "block twice a step (once in forward, once in backward), hidden behind compute "
             "only where the blocks compute longer than they copy. LoRA / LoKr / LoHa: "
             "the frozen weights move, the adapters stay. A full fine-tune (FINE_TUNE, with "
             "training.fused_backward=true) also keeps those blocks' trained weights and "
             "their optimizer state in CPU memory: each weight's gradient is copied to the "
             "host as backward makes it and the optimizer steps it there (CPU time each "
             "step); saves their weights and optimizer state on the device. Not with "
             "whole-model (FULL) compile of the denoiser, use REGIONAL. docs/memory.md has "
             "the details.")
    train_dtype: DType = setting(DType.FLOAT32, label="Trained weights dtype", group="Model",
                                 help="Data type of the weights being trained (the optimizer "
                                      "keeps its state in this type).")
    tokenizer_path: str = setting(
        "", label="Tokenizer folder", group="Model", path=True, advanced=True,
        on_resume=OnResume.MAY_CHANGE,
        help="For a single-file checkpoint: a diffusers folder of the same family whose "
             "tokenizer/ (and tokenizer_2/) Tempera uses, since checkpoints carry no tokenizer. "
             "Empty looks next to the checkpoint.")
    config_path: str = setting(
        "", label="Architecture config folder", group="Model", path=True, advanced=True,
        help="For a single-file checkpoint: a diffusers folder whose config.json files describe "
             "its architecture. Empty uses the SD 1.x / 2.x / XL configs shipped with Tempera.")
    text_encoder_path: str = setting(
        "", label="Text encoder file", group="Model", path=True, files=("*.safetensors",),
        advanced=True,
        help="Z-Image or Flux.2 Klein from ComfyUI's files: the Qwen3 text encoder's "
             ".safetensors (models/text_encoders/qwen_3_4b.safetensors; Klein 9B reads "
             "Qwen3-8B), with model.path the diffusion model's and model.vae_path the VAE's. "
             "Empty for a diffusers folder.")
    vae_path: str = setting(
        "", label="VAE file", group="Model", path=True, files=("*.safetensors",),
        advanced=True,
        help="Z-Image or Flux.2 Klein from ComfyUI's files: the VAE's .safetensors "
             "(models/vae: Flux.1's 16-channel ae.safetensors for Z-Image, Flux.2's "
             "32-channel VAE for Klein). Empty for a diffusers folder.")
    train_distilled: bool = setting(
        False, label="Train a distilled model", group="Model", advanced=True,
        help="Z-Image-Turbo and the Flux.2 Klein 4B and 9B (not base) models are "
             "step-distilled, and training them breaks their distillation: they are refused "
             "unless this is on (with a de-distillation training adapter merged in, say). "
             "Train Z-Image Base, Klein base 4B or 9B, or a de-distilled model instead.")
    allow_pickle: bool = setting(
        False, label="Allow pickle checkpoints", group="Model", advanced=True,
        on_resume=OnResume.MAY_CHANGE,
        help="Load .ckpt/.pt/.bin checkpoints. Unpickling can run code hidden in a file, so this "
             "is off; when on, Tempera loads them with torch.load(weights_only=True).")
    prediction_type: PredictionType = setting(
        PredictionType.AUTO, label="Prediction type", group="Model", advanced=True,
        help="What the UNet predicts. AUTO reads it from the model's scheduler config "
             "(SD 1.x: EPSILON, SD 2.x 768: V_PREDICTION). SDXL v-prediction models "
             "(NoobAI-XL v-pred and the like) need V_PREDICTION set here.")
    zero_terminal_snr: bool = setting(
        False, label="Zero terminal SNR", group="Model", advanced=True,
        help="Rescale the noise schedule so its last timestep is pure noise (Lin et al. "
             "2023), for training and for samples (which then space their steps 'trailing'). "
             "Needs V_PREDICTION: an epsilon model cannot predict the noise from pure noise. "
             "Turn on for models trained this way (NoobAI-XL v-pred).")


# training.lokr_factor besides -1 (the balanced split): peft uses the factor where it divides
# a layer's dimension, else the largest divisor below both it and the dimension's square root,
# so a factor above every dimension's root silently acts as -1 (1024 did). Every layer
# dimension of SD 1.x / 2.x and SDXL is a multiple of 64, so the range ends there; 0 and 1
# leave the small factor 1 x 1 (validation refuses them, with the range).
LOKR_FACTORS = (2, 64)


@dataclass
class TrainingConfig:
    method: TrainingMethod = setting(TrainingMethod.LORA, label="Method", group="Training",
                                     compile_check=True, on_resume=OnResume.MUST_MATCH,
                                     help="LORA trains small adapter matrices; FINE_TUNE trains the "
                                          "full weights of the selected components; "
                                          "TEXTUAL_INVERSION trains only new token embeddings "
                                          "in the text encoder(s) (the textual_inversion "
                                          "section; docs/textual_inversion.md).")
    lora_rank: int = setting(16, label="LoRA rank", group="Training", min=1, max=1024,
                             on_resume=OnResume.MUST_MATCH,
                             help="Rank of the LoRA matrices.")
    lora_alpha: float = setting(16.0, label="LoRA alpha", group="Training", min=0.0, max=100_000.0,
                                on_resume=OnResume.MUST_MATCH,
                                help="LoRA scaling numerator: the update is scaled by alpha / rank.")
    lora_target_modules: list[str] = setting(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        label="LoRA target modules", on_resume=OnResume.MUST_MATCH, group="Training", advanced=True,
        help="Names of the layers that get adapters in the denoiser (the UNet or the "
             "transformer): each adapts every layer whose path ends in it (to_q, or attn1.to_q "
             "for fewer). A name that matches no layer is refused.")
    adapter: Adapter = setting(
        Adapter.LORA, label="Adapter", group="Training", compile_check=True,
        on_resume=OnResume.MUST_MATCH,
        help="With method LORA, which adapter: LORA (low-rank matrices on the attention "
             "layers), LOCON (LoRA on the projections, feed-forward and time-embedding layers "
             "too, and on the ResNet convolutions at training.conv_rank), LOHA (Hadamard "
             "product of two low-rank pairs) and LOKR (Kronecker product) on the LoCon layers, "
             "DORA (LoRA plus a trained magnitude per output channel). docs/adapters.md "
             "compares them.")
    conv_rank: int = setting(
        0, label="Conv rank", group="Training", min=0, max=1024, on_resume=OnResume.MUST_MATCH,
        help="Rank of the adapters on the UNet's convolutions larger than 1x1 (ResNet conv1 / "
             "conv2, down- and upsamplers): LOCON, LOHA, LOKR and DORA; 0 adapts no "
             "convolution.")
    conv_alpha: float = setting(
        1.0, label="Conv alpha", group="Training", min=0.0, max=100_000.0,
        on_resume=OnResume.MUST_MATCH,
        help="Alpha of the convolution adapters: their update is scaled by conv alpha / conv "
             "rank (kohya's conv_alpha; 1 is usual).")
    use_rslora: bool = setting(
        False, label="Rank-stabilised scaling", group="Training", advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="rsLoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank, so a "
             "higher rank does not shrink it (LORA, LOCON, DORA). Saved kohya files carry an "
             "alpha adjusted so other tools apply the same strength.")
    lora_dropout: float = setting(
        0.0, label="Adapter dropout", group="Training", min=0.0, max=0.9, advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="LORA, LOCON, DORA: dropout on each adapter's input while training (peft's "
             "lora_dropout); 0 is off.")
    module_dropout: float = setting(
        0.0, label="Module dropout", group="Training", min=0.0, max=0.9, advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="LOHA, LOKR: leave a layer's whole adapter out of a training step with this "
             "probability (LyCORIS's module_dropout); 0 is off.")
    rank_dropout: float = setting(
        0.0, label="Rank dropout", group="Training", min=0.0, max=0.9, advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="LOHA, LOKR: zero each output row of the adapter's update with this probability "
             "while training (LyCORIS's rank_dropout); 0 is off.")
    lokr_factor: int = setting(
        -1, label="LoKr factor", group="Training", min=-1, max=LOKR_FACTORS[1], advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="LOKR: the size of the Kronecker product's small factor: each layer dimension is "
             "split as factor x rest where the factor divides it (else its largest divisor "
             "below both the factor and its square root). -1 splits every dimension as evenly "
             "as possible; otherwise 2 to 64 (SD and SDXL layer dimensions are multiples of "
             "64, so a power of two up to 64 applies as given everywhere; 4 to 16 is usual).")
    optimizer: Optimizer = setting(Optimizer.ADAMW, label="Optimizer", group="Training",
                                   on_resume=OnResume.MUST_MATCH,
                                   help="ADAMW; ADAMW_8BIT (bitsandbytes, CUDA only); PRODIGY "
                                        "(finds its own step size: set the learning rate to "
                                        "1.0); ADAFACTOR (fixed learning rate) or "
                                        "ADAFACTOR_RELATIVE (its own step size, CONSTANT "
                                        "schedule); LION (use about a tenth of AdamW's rate); "
                                        "SCHEDULE_FREE_ADAMW (no schedule: CONSTANT); CAME. "
                                        "docs/optimizers.md compares them.")
    learning_rate: float = setting(1e-4, label="Learning rate", group="Training", min=0.0, max=1.0,
                                   help="Base learning rate; a component may override it.")
    weight_decay: float = setting(1e-2, label="Weight decay", group="Training", min=0.0, max=1.0,
                                  on_resume=OnResume.MUST_MATCH,
                                  advanced=True, help="AdamW weight decay.")
    lr_scheduler: LRScheduler = setting(
        LRScheduler.CONSTANT, label="LR scheduler", group="Training",
        help="How the learning rate changes over the run, after the warm-up: CONSTANT, LINEAR "
             "or COSINE to zero at the last step, COSINE_WITH_RESTARTS (training.lr_cycles "
             "cosines), POLYNOMIAL (training.lr_power), INVERSE_SQRT (one over the square "
             "root of the step). docs/schedules.md draws each.")
    lr_warmup_steps: int = setting(0, label="Warmup steps", group="Training", min=0, max=10_000_000,
                                   help="Steps over which the learning rate ramps up from zero.")
    lr_warmup_ratio: float = setting(
        0.0, label="Warmup ratio", group="Training", min=0.0, max=0.99, advanced=True,
        help="The warm-up as a share of the run's steps (0.05 = the first 5 %); 0 uses "
             "training.lr_warmup_steps. Set one of the two.")
    lr_cycles: int = setting(1, label="Cosine restarts", group="Training", min=1, max=1000,
                             advanced=True,
                             help="COSINE_WITH_RESTARTS: how many cosines the run is split into "
                                  "(the rate jumps back to the base rate at each).")
    lr_power: float = setting(1.0, label="Polynomial power", group="Training", min=0.01,
                              max=100.0, advanced=True,
                              help="POLYNOMIAL: the decay's exponent (1 is LINEAR; above 1 falls "
                                   "fast early, below 1 late).")
    epochs: int = setting(1, label="Epochs", group="Training", min=1, max=1_000_000,
                          help="Passes over the dataset (ignored when max steps is set).")
    max_steps: int = setting(0, label="Max steps", group="Training", min=0, max=100_000_000,
                             help="Optimizer steps to train for; 0 means train for 'epochs'.")
    batch_size: int = setting(1, label="Batch size", group="Training", min=1, max=4096,
                              on_resume=OnResume.MUST_MATCH,
                              help="Images per forward pass.")
    gradient_accumulation: int = setting(1, label="Gradient accumulation", group="Training",
                                         on_resume=OnResume.MUST_MATCH,
                                         min=1, max=4096,
                                         help="Forward passes summed into one optimizer step.")
    # A compilation check depends on it: REGIONAL with checkpointing turns CUDA graphs off.
    gradient_checkpointing: bool = setting(False, label="Gradient checkpointing", group="Training",
                                           compile_check=True,
                                           help="Recompute activations in backward to save memory.")
    channels_last: bool = setting(False, label="Channels-last UNet", group="Training",
                                  compile_check=True,
                                  advanced=True,
                                  help="Store the denoiser (UNet) weights and its activations in "
                                       "channels-last memory layout, which can speed up "
                                       "convolutions on NVIDIA tensor cores. Same results; off "
                                       "by default until docs/benchmarks.md shows it pays on a "
                                       "GPU.")
    mixed_precision: MixedPrecision = setting(MixedPrecision.NO, label="Mixed precision",
                                              compile_check=True, on_resume=OnResume.MUST_MATCH,
                                              group="Training",
                                              help="Autocast the forward pass to FP16 or BF16.")
    allow_tf32: bool = setting(True, label="Allow TF32", group="Training", advanced=True,
                               help="Let float32 matrix products and convolutions on NVIDIA "
                                    "GPUs (Ampere and newer) use TF32 tensor cores: several "
                                    "times faster, with a 10-bit mantissa. Off keeps full "
                                    "float32. No effect on the CPU.")
    max_grad_norm: float = setting(1.0, label="Max gradient norm", group="Training", min=0.0,
                                   max=1e6, advanced=True,
                                   help="Clip gradients to this norm; 0 disables clipping.")
    noise_offset: float = setting(0.0, label="Noise offset", group="Training", min=0.0, max=1.0,
                                  on_resume=OnResume.MUST_MATCH,
                                  help="Add a per-channel constant to the noise so the model can "
                                       "learn very dark and very bright images; 0 is off, 0.05 "
                                       "to 0.1 is typical. loss.adaptive_noise_scale adds to it "
                                       "per image.")
    min_snr_gamma: float = setting(0.0, label="Min-SNR gamma", group="Training", min=0.0,
                                   on_resume=OnResume.MUST_MATCH,
                                   max=100.0,
                                   help="Min-SNR loss weighting (gamma 5 is the usual choice); "
                                        "0 is off.")
    prior_loss_weight: float = setting(
        1.0, label="Prior loss weight", group="Training", min=0.0, max=100.0,
        on_resume=OnResume.MUST_MATCH,
        help="How much the loss of a regularisation (class) image counts against a training "
             "image's (DreamBooth prior preservation; 1.0 as in kohya's sd-scripts). Only "
             "used when a dataset is marked as regularisation images.")
    ema: bool = setting(False, label="EMA", on_resume=OnResume.MUST_MATCH, group="Training",
                        help="Keep an exponential moving average of the trained weights; "
                             "samples and saves use the average.")
    ema_decay: float = setting(0.999, label="EMA decay", group="Training", min=0.0, max=1.0,
                               on_resume=OnResume.MUST_MATCH,
                               advanced=True, help="How slowly the average follows the weights.")
    max_bad_steps: int = setting(
        5, label="Max non-finite steps", group="Training", min=1, max=1000, advanced=True,
        help="A step whose loss or gradients are NaN/inf is skipped (the weights stay good); "
             "this many in a row stop the run with an error.")
    # --- fused backward (issue 46 item 4; docs/memory.md "Fused backward") ---
    fused_backward: bool = setting(
        False, label="Fused backward", group="Training", advanced=True,
        on_resume=OnResume.MUST_MATCH,
        help="FINE_TUNE only: step each weight's optimizer as soon as its gradient is "
             "ready and free that gradient, so the full set of gradients never exists at "
             "once (saves about one copy of the trained weights: 2 bytes per bfloat16 "
             "weight). With model.train_dtype BFLOAT16 the weights are updated with "
             "stochastic rounding (torchao's AdamW; optimizer ADAMW only). Costs: "
             "max_grad_norm clips each weight's gradient on its own (no global norm), one "
             "host sync per weight for the NaN check. Cannot combine with gradient "
             "accumulation above 1, FP16 mixed precision, several processes, PRODIGY or "
             "SCHEDULE_FREE_ADAMW. docs/memory.md has the details.")
    resume_from: str = setting(
        "", label="Resume from", on_resume=OnResume.IGNORED, group="Training", advanced=True,
        help='Continue an interrupted run: "latest" (the newest backup in the output folder) or '
             "a backup folder (relative paths are inside the output folder). The config must "
             "match the backup's in what changes the math (docs/resume.md); empty starts anew. "
             "A finished run continues only when training.max_steps is raised above its end.")
    seed: int = setting(42, label="Seed", group="General", min=0, max=2**32 - 1,
                        on_resume=OnResume.MUST_MATCH,
                        help="Seed for noise, timesteps, shuffling and weight init.")
    # -- issue 46 item 6: sharding over several processes (docs/cloud.md, "Multi-GPU") --
    distributed_strategy: DistributedStrategy = setting(
        DistributedStrategy.DDP, label="Multi-process strategy", group="Training",
        # a memory switch: backups are the same whole-state format under either
        # (train/state/sharded_state.py); the sums differ only in the order of float additions
        advanced=True, on_resume=OnResume.MAY_CHANGE,
        help="Only when launched as several processes (accelerate launch / torchrun). DDP: "
             "every process holds the whole model and the gradients are averaged. FSDP: a "
             "full fine-tune's trained weights, gradients and optimizer state are split over "
             "the processes (FSDP2), each repeated block gathered just for its own forward "
             "and backward, so a model that does not fit one card trains on several. FSDP is "
             "for training.method FINE_TUNE only; it cannot be combined with EMA, FLOAT16 "
             "mixed precision, or optimizers other than AdamW (docs/cloud.md, Multi-GPU).")


@dataclass
class ComponentConfig:
    train: bool = setting(False, label="Train", group="Training",
                          help="Train this component (its LoRA adapters, or its full weights).")
    learning_rate: float | None = setting(None, label="Learning rate", group="Training",
                                          on_resume=OnResume.MAY_CHANGE,
                                          min=0.0, max=1.0,
                                          help="Learning rate for this component; empty uses the "
                                               "training learning rate.")


@dataclass
class ComponentsConfig:
    denoiser: ComponentConfig = setting(
        default_factory=lambda: ComponentConfig(train=True), label="UNet", group="Training",
        help="The denoising UNet.")
    text_encoder: ComponentConfig = setting(default_factory=ComponentConfig, label="Text encoder",
                                            group="Training", help="The (first) CLIP text encoder.")
    text_encoder_2: ComponentConfig = setting(default_factory=ComponentConfig,
                                              label="Text encoder 2", group="Training",
                                              help="The second text encoder (SDXL only).")
    vae: ComponentConfig = setting(default_factory=ComponentConfig, label="VAE", group="Training",
                                   help="The autoencoder. Tempera does not train it; it can be "
                                        "compiled.")


@dataclass
class CompileConfig:
    backend: CompileBackend = setting(
        CompileBackend.NONE, label="Backend", group="Advanced",
        help="torch.compile backend. NONE: eager. DEFAULT: torch's default (inductor). "
             "INDUCTOR: inductor with autotune, no CUDA graphs. TRITON: inductor with autotune "
             "and CUDA graphs (there is no torch backend named 'triton'). AOT_EAGER: "
             "AOTAutograd graphs run with eager kernels.")
    denoiser: bool = setting(True, label="Compile UNet", group="Advanced",
                             help="Compile the UNet (the biggest gain).")
    text_encoder: bool = setting(False, label="Compile text encoder", group="Advanced",
                                 help="Compile every text encoder the model type has.")
    vae: bool = setting(False, label="Compile VAE", group="Advanced",
                        help="Compile the VAE encoder (training, latent caching) and decoder "
                             "(sampling).")
    scope: CompileScope = setting(
        CompileScope.REGIONAL, label="Scope", group="Advanced",
        help="REGIONAL compiles each repeated block (transformer and resnet blocks) so the "
             "compiled code is reused across blocks: a much shorter cold start. FULL compiles "
             "each component whole. AUTO measures eager, REGIONAL and FULL briefly the first "
             "time this device, model family, backend, batch and resolution are met, keeps the "
             "fastest step (stored in the compile cache folder's bundles/ for later runs) and "
             "says so; where it cannot measure, REGIONAL.")
    mode: CompileMode = setting(
        CompileMode.DEFAULT, label="Mode", group="Advanced",
        help="torch.compile mode, merged into the backend's inductor options.")
    dynamic: DynamicShapes = setting(
        DynamicShapes.AUTO, label="Dynamic shapes", group="Advanced",
        help="AUTO (recommended): compile for the first shapes, and for varying sizes only "
             "where they vary (aspect-ratio buckets are marked up front). DYNAMIC: every size "
             "symbolic from the first compile (slower to compile). STATIC: one compile per "
             "shape.")
    fullgraph: bool = setting(False, label="Full graph", group="Advanced",
                              help="Fail on any graph break (for diagnosing); off by default.")
    cache_dir: str = setting("", label="Compile cache folder", group="Advanced", path=True,
                             help="Persistent compile cache reused across runs. Empty means "
                                  "<cache folder>/compile.")
    bundles: bool = setting(
        True, label="Compile bundles", group="Advanced",
        help="Before the first step, load the compile bundle made for these settings on this "
             "kind of machine (a file of compiled code: the cache folder's bundles/, or "
             "compile.bundle); after a step that compiled something new, write one there. A "
             "bundle carried to a new machine or cloud run makes its first step warm. "
             "docs/compilation.md says more.")
    bundle: str = setting(
        "", label="Compile bundle to start from", group="Advanced", path=True,
        files=("*.tcb",),
        help="A compile bundle file (.tcb) or a folder of them, looked in before the cache "
             "folder's bundles/ (e.g. one exported on another machine). One made for other "
             "settings, another torch or another GPU is not loaded; the run says which part "
             "differed.")
    ahead: bool = setting(
        False, label="Compile ahead", group="Advanced",
        help="While the captions and latents are cached, compile the batch shapes the run "
             "will meet in a process of its own and write the compile bundle the run then "
             "loads, so the first step does not compile. On the CPU only (on a GPU it would "
             "need a second copy of the weights there); needs an inductor backend and "
             "compile.bundles. It pays only with cores to spare (at least twice the run's "
             "threads): on fewer, caching and compiling share them and step 1 comes later. A "
             "failed compile ahead is reported and the run compiles at step 1. "
             "docs/compilation.md says what it costs.")
    strict: bool = setting(False, label="Strict", group="Advanced",
                           help="Make any compile failure fatal instead of falling back to the "
                                "next backend.")


@dataclass
class Config:
    config_version: int = setting(CONFIG_VERSION, label="Config version", group="General",
                                  advanced=True, help="Schema version of this file.")
    general: GeneralConfig = setting(default_factory=GeneralConfig, label="General",
                                     on_resume=OnResume.IGNORED,
                                     group="General", help="Device and caches.")
    model: ModelConfig = setting(default_factory=ModelConfig, label="Model", group="Model",
                                 compile_check=True, on_resume=OnResume.MUST_MATCH,
                                 help="The base model.")
    data: DataConfig = setting(default_factory=DataConfig, label="Data", group="Data",
                               on_resume=OnResume.MUST_MATCH,
                               help="Training images and captions.")
    training: TrainingConfig = setting(default_factory=TrainingConfig, label="Training",
                                       group="Training", help="Optimisation settings.")
    loss: LossConfig = setting(default_factory=LossConfig, label="Noise and loss",
                               group="Training", on_resume=OnResume.MUST_MATCH,
                               help="How the noise is drawn and the error weighed "
                                    "(docs/noise_and_loss.md).")
    components: ComponentsConfig = setting(default_factory=ComponentsConfig, label="Components",
                                           compile_check=True, on_resume=OnResume.MUST_MATCH,
                                           group="Training", help="Per-component settings.")
    compile: CompileConfig = setting(default_factory=CompileConfig, label="Model compilation",
                                     compile_check=True,
                                     group="Advanced", help="torch.compile settings.")
    sampling: SamplingConfig = setting(default_factory=SamplingConfig, label="Sampling",
                                       group="Sampling", help="Sample images during training.")
    validation: ValidationConfig = setting(default_factory=ValidationConfig,
                                           label="Validation", group="Data",
                                           # scoring, not training: split_ratio, which
                                           # takes images out of training, must match
                                           on_resume=OnResume.MAY_CHANGE,
                                           help="A held-out split scored during training.")
    output: OutputConfig = setting(default_factory=OutputConfig, label="Output", group="General",
                                   help="Where results go.")
    logging: LoggingConfig = setting(default_factory=LoggingConfig, label="Logging",
                                     on_resume=OnResume.IGNORED,
                                     group="General", help="Logging.")
    # --- textual inversion (issue 47) ---
    textual_inversion: TextualInversionConfig = setting(
        default_factory=TextualInversionConfig, label="Textual inversion", group="Training",
        compile_check=True, on_resume=OnResume.MUST_MATCH,
        help="The new token training.method=TEXTUAL_INVERSION trains.")
