"""The presets for small cards (issue 46 item 5) against the memory plan at the real models'
sizes: each plan is built on the meta device from the shipped configs
(modules/models/configs/), so nothing is loaded and no weights are needed. A preset for an
N GB card keeps its plan within half of N GiB (docs/memory.md, "Presets for small cards"): the
other half is for activations, the CUDA context and the compiler's workspaces. Each preset's
8-bit storage is checked too: on where the card needs it, off where the plan fits without it,
and the one the plan picks (levers.py's `picked_storage`: INT8, on an RTX 30 card and on a
newer one alike). Klein's presets are planned on the 4B's or the 9B's configs (`CONFIGS`).
(Over 10 s: eleven real-size plans, the first paying for importing the model classes.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from modules.config.loader import load_config, to_dict
from modules.config.overrides import apply_overrides
from modules.config.schema import Config, WeightStorage
from modules.train.memory.levers import DeviceAbility, picked_storage
from modules.train.memory.memory_plan import GIB, MemoryPlan, plan_memory
from modules.train.recipe.placement import components_off_device

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "training_presets"
DATA = 'data.datasets=[{"path": "builtin:shapes"}]'
HEADROOM = 0.5  # the share of the card a preset's plan may take (docs/memory.md)

# preset -> (the card it is for, in GiB; whether its frozen weights need 8 bits to fit)
CARDS = {"sd15/lora_6gb.json": (6, False), "sdxl/lora_12gb.json": (12, False),
         "sdxl/lora_8gb.json": (8, True), "zimage/lora_16gb.json": (16, True),
         "klein/lora_4b_12gb.json": (12, True), "klein/lora_4b_16gb.json": (16, False),
         "klein/lora_4b_24gb.json": (24, False), "klein/lora_9b_16gb.json": (16, True),
         "klein/lora_9b_24gb.json": (24, True), "klein/fine_tune_4b_48gb.json": (48, False),
         "klein/fine_tune_4b_80gb.json": (80, False)}
# the shipped configs a preset's plan is computed on, where the folder is not its family's
# (one family, two sizes)
CONFIGS = {"klein/lora_4b_12gb.json": "klein4b", "klein/lora_4b_16gb.json": "klein4b",
           "klein/lora_4b_24gb.json": "klein4b", "klein/lora_9b_16gb.json": "klein9b",
           "klein/lora_9b_24gb.json": "klein9b", "klein/fine_tune_4b_48gb.json": "klein4b",
           "klein/fine_tune_4b_80gb.json": "klein4b"}
# a lever other than 8-bit storage a preset pulls, and the overrides that undo it: without it
# the plan would not fit (9B on 16 GB: INT8 alone does not, nor its 5 blocks offloaded in bf16)
LEVERS = {"klein/lora_9b_16gb.json": [["model.offload_blocks=0"],
                                       ["model.weight_storage=WEIGHT_DTYPE"]],
          "klein/fine_tune_4b_48gb.json": [["training.optimizer=ADAMW"]]}


# the cards a preset of that size may meet: an RTX 30 (no float8) and an RTX 40
CARD_ABILITIES = (DeviceAbility("RTX 3060 (sm_86)", (8, 6)),
                  DeviceAbility("RTX 4060 (sm_89)", (8, 9)))


def _eight_bit_as_bf16(plan) -> int:
    """What the plan's 8-bit weights would take in bf16 (2 bytes a value) more than they
    take now."""
    extra = 0
    for what, size in plan.lines:
        found = re.search(r"stored as (?:float8|int8) \(([\d,]+) values", what)
        if found:
            extra += int(found.group(1).replace(",", "")) * 2 - size
    return extra


_PLANS: dict[tuple[str, str], MemoryPlan] = {}


def plan_of(config: Config, folder: Path) -> MemoryPlan:
    """`plan_memory`, once per distinct config (description and output folder aside: the plan
    reads neither) and model: a lever's
    undone config is often another preset's (the 9B's offload undone and INT8 on is
    lora_9b_24gb; Adafactor undone is fine_tune_4b_80gb), and a real-size plan takes seconds."""
    tree = to_dict(config)
    tree["general"].pop("description")
    tree["output"].pop("dir")
    key = (repr(tree), str(folder))
    if key not in _PLANS:
        _PLANS[key] = plan_memory(config, folder)
    return _PLANS[key]


@pytest.mark.parametrize("preset", sorted(CARDS))
def test_the_preset_fits_its_card_with_the_headroom(preset):
    card, needs_8bit = CARDS[preset]
    config = apply_overrides(load_config(PRESETS / preset), [DATA])
    folder = REPO / "modules" / "models" / "configs" / CONFIGS.get(preset,
                                                                   preset.split("/")[0])
    plan = plan_of(config, folder)
    assert plan.total <= HEADROOM * card * GIB, plan.describe()
    # the text encoders and the VAE are off the card (their outputs cached)
    assert set(components_off_device(config)) >= {"vae", "text_encoder"}
    assert config.training.gradient_checkpointing
    storage = config.model.weight_storage
    assert storage.eight_bit == needs_8bit
    if needs_8bit:  # without it the plan would not fit: the quality cost is paid for a reason
        assert plan.total + _eight_bit_as_bf16(plan) > HEADROOM * card * GIB
        assert {picked_storage(a) for a in CARD_ABILITIES} == {storage} == {WeightStorage.INT8}
    for undo in LEVERS.get(preset, []):  # each other lever is pulled for a reason too
        without = plan_of(apply_overrides(config, undo), folder)
        assert without.total > HEADROOM * card * GIB, (undo, without.total / GIB)
    # the description names the card and the plan's total, as the plan computes it
    description = config.general.description
    assert f"{card} GB card" in description
    assert f"{plan.total / GIB:.2f} GiB" in description, (description, plan.total / GIB)


def test_the_gui_lists_the_card_presets(tmp_path):
    from app.presets import BUILTIN_PRESETS_DIR, list_presets
    labels = {entry.label for entry in list_presets(BUILTIN_PRESETS_DIR, tmp_path)}
    assert {"sd15 / lora_6gb", "sdxl / lora_12gb", "sdxl / lora_8gb",
            "zimage / lora_16gb"} <= labels
