"""The adapters, as a table: which peft class builds each, which options it has, which layers
it adapts and which file layouts can carry it.

Data only (class names as strings, nothing imported): validation reads it to refuse an option
or a save format a method cannot honour, modules/train/recipe/adapters.py builds the peft config from
it, and modules/models/kohya.py names the saved tensors from what peft built.

peft implements every method (LoRA with rsLoRA and DoRA, LoHa, LoKr): one maintained library
whose layers are close to LyCORIS's definitions, instead of Tempera's own adapter maths. The
file layout other tools read is LyCORIS's (docs/adapters.md says why and what each costs).
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.config.schema import Adapter, SaveFormat

# The layers the LoCon family adapts besides the attention projections (training.lora_target_
# modules): the transformer blocks' input/output projections, feed-forward and the ResNets'
# time embedding. Module names are peft suffixes: "ff.net.2" matches
# "...transformer_blocks.0.ff.net.2".
LOCON_LINEAR_TARGETS = ("proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "time_emb_proj",
                        "conv_shortcut")
# The convolutions larger than 1x1 (training.conv_rank / conv_alpha): ResNet convs and the
# down- / upsamplers' convs.
CONV_TARGETS = ("conv1", "conv2", "conv")
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TEXT_ENCODER_LOCON_TARGETS = ("fc1", "fc2")


@dataclass(frozen=True)
class AdapterRow:
    label: str
    peft_config: str                 # class name in peft
    locon_layers: bool               # adapts LOCON_LINEAR_TARGETS besides the attention
    convolutions: bool               # may adapt CONV_TARGETS (training.conv_rank > 0)
    needs_convolutions: bool = False  # conv_rank 0 would make it another method
    options: tuple[str, ...] = ()    # training.* options it has beyond rank and alpha
    formats: frozenset = frozenset({SaveFormat.DIFFUSERS, SaveFormat.KOHYA})
    kohya_network_module: str = "networks.lora"  # ss_network_module in saved kohya files
    lycoris_algo: str = ""           # ss_network_args' algo, for LyCORIS-made files


LORA_OPTIONS = ("use_rslora", "lora_dropout")
LYCORIS_OPTIONS = ("module_dropout", "rank_dropout")
KOHYA_ONLY = frozenset({SaveFormat.KOHYA})

ADAPTERS: dict[Adapter, AdapterRow] = {
    Adapter.LORA: AdapterRow("LoRA", "LoraConfig", locon_layers=False, convolutions=False,
                             options=LORA_OPTIONS),
    Adapter.LOCON: AdapterRow("LoCon", "LoraConfig", locon_layers=True, convolutions=True,
                              needs_convolutions=True, options=LORA_OPTIONS),
    Adapter.LOHA: AdapterRow("LoHa", "LoHaConfig", locon_layers=True, convolutions=True,
                             options=LYCORIS_OPTIONS, formats=KOHYA_ONLY,
                             kohya_network_module="lycoris.kohya", lycoris_algo="loha"),
    Adapter.LOKR: AdapterRow("LoKr", "LoKrConfig", locon_layers=True, convolutions=True,
                             options=(*LYCORIS_OPTIONS, "lokr_factor"), formats=KOHYA_ONLY,
                             kohya_network_module="lycoris.kohya", lycoris_algo="lokr"),
    Adapter.DORA: AdapterRow("DoRA", "LoraConfig", locon_layers=False, convolutions=True,
                             options=LORA_OPTIONS, kohya_network_module="lycoris.kohya",
                             lycoris_algo="lora"),
}
# What each option is off at (validation refuses a non-default value for a method without it).
OPTION_OFF = {"use_rslora": False, "lora_dropout": 0.0, "module_dropout": 0.0,
              "rank_dropout": 0.0, "lokr_factor": -1}
