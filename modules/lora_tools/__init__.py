"""LoRA tools beside training: merge into a base model, merge several LoRAs, extract from two
checkpoints, resize a rank, convert between the diffusers/peft and kohya layouts
(docs/lora_tools.md). The command line is `tempera-lora` (`modules/cli/lora.py`), the
window's form the LoRA tools tab (`app/lora_tools_panel.py`).
"""
