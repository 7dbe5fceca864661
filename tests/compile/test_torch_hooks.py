"""The private torch hooks Tempera's compile report reads, one test each.

torch offers no public API for these (as of 2.13): compile start/end callbacks, the graph and
cache counters, the guard failures behind a recompile, the recompile-limit message, and the
module attribute a compiled module calls. Each test fails when a torch upgrade makes its hook
stop reporting, so the report cannot go silently blank. The public equivalents that exist are
named: `TORCH_LOGS=recompiles` / `torch._logging.set_logs(recompiles=True)` prints recompile
reasons (a log stream, not data), `torch.compiler.set_stance` (used by the engine to bypass
compiled code while sampling) and `torch.compiler.reset`.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Small(nn.Module):
    """A module defined outside torch (dynamo does not trace frames of torch's own files)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def compiled_linear(backend: str = "eager") -> nn.Module:
    module = Small()
    module.compile(backend=backend, dynamic=False)
    return module


def test_compile_start_and_end_callbacks_fire_with_a_compile_id():
    from torch._dynamo.callback import CallbackTrigger

    seen: list[tuple[str, object, str]] = []

    def start(args):
        seen.append(("start", args.callback_trigger, str(args.compile_id)))

    def end(args):
        seen.append(("end", args.callback_trigger, str(args.compile_id)))

    handler = torch._dynamo.callback_handler
    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        compiled_linear()(torch.randn(2, 4))
    finally:
        handler.remove_start_callback(start)
        handler.remove_end_callback(end)
    kinds = [kind for kind, _, _ in seen]
    assert kinds[:2] == ["start", "end"]
    assert seen[0][1] == CallbackTrigger.DYNAMO and "0/0" in seen[0][2]


def test_the_graph_counter_counts_each_new_graph():
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    compiled_linear()(torch.randn(2, 4))
    assert counters["stats"]["unique_graphs"] == before + 1


def test_a_recompile_records_its_guard_failure_and_a_new_attempt_id():
    from torch._dynamo.utils import guard_failures

    ids: list[str] = []
    handler = torch._dynamo.callback_handler
    record = lambda args: ids.append(str(args.compile_id))  # noqa: E731
    handler.register_start_callback(record)
    try:
        module = compiled_linear()
        module(torch.randn(2, 4))
        module(torch.randn(3, 4))  # another batch size with dynamic=False: a recompile
    finally:
        handler.remove_start_callback(record)
    reasons = [reason for every in guard_failures.values() for reason in every]
    assert any("size" in str(reason) for reason in reasons), reasons
    assert any(i.endswith("/1") for i in ids), ids  # frame/attempt, attempt 1 = a recompile


def test_hitting_the_recompile_limit_is_counted_under_unimplemented():
    from modules.compile.tracking import _recompile_limit_hits

    with torch._dynamo.config.patch(recompile_limit=1):
        module = compiled_linear()
        before = _recompile_limit_hits()
        for batch in (2, 3, 5):
            module(torch.randn(batch, 4))
        assert _recompile_limit_hits() > before


def test_a_compiled_module_calls_through_compiled_call_impl():
    from modules.compile.tracking import CompileTracker, TrackedCall

    module = compiled_linear()
    assert callable(module._compiled_call_impl)
    tracker = CompileTracker()
    module._compiled_call_impl = TrackedCall(module._compiled_call_impl, tracker, "unet")
    module(torch.randn(2, 4))
    assert tracker.component("unet").calls == 1


def test_the_cache_counters_exist_for_the_backends_that_cache():
    """The FX-graph and AOTAutograd cache counters are plain defaultdict entries, so a renamed
    key would read 0 forever: the engine's snapshot must see aot_autograd count something."""
    from torch._dynamo.utils import counters

    module = compiled_linear("aot_eager")
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    autograd = counters["aot_autograd"]
    assert any(key.startswith("autograd_cache") for key in autograd) or autograd["total"] >= 1
