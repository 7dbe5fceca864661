"""The lever table's device rule and the GUI's one-line summaries (train/memory/levers.py,
issue 58 items 5 and 6): no model, no plan."""
from __future__ import annotations

from modules.config.schema import WeightStorage
from modules.train.memory.levers import (CPU, STORAGE_LEVERS, DeviceAbility, picked_storage,
                                         storage_summaries)

RTX_3090 = DeviceAbility("NVIDIA GeForce RTX 3090 (sm_86)", (8, 6))
RTX_4090 = DeviceAbility("NVIDIA GeForce RTX 4090 (sm_89)", (8, 9))


def test_each_storage_says_what_it_saves_and_costs_or_why_this_machine_cannot_run_it():
    int8, float8, w8a8 = storage_summaries(RTX_3090)
    assert w8a8 == STORAGE_LEVERS[WeightStorage.W8A8].short  # sm_86 multiplies int8
    assert int8 == STORAGE_LEVERS[WeightStorage.INT8].short
    assert "half of bf16" in int8 and "quality -2.3 %" in int8 and "dequantize" in int8
    assert float8.startswith("FLOAT8: not on this machine: NVIDIA GeForce RTX 3090 (sm_86) is "
                             "older than sm_89: inductor's GPU code (Triton) cannot convert")
    for ability in (RTX_4090, CPU):
        assert storage_summaries(ability) == [lever.short for lever in STORAGE_LEVERS.values()]
    assert "quality -4.7 %" in storage_summaries(RTX_4090)[1]
    assert {picked_storage(a) for a in (RTX_3090, RTX_4090, CPU)} == {WeightStorage.INT8}
