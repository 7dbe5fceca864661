"""Attribute dynamo's compile work to components: graphs, seconds, recompiles, cache hits, calls.

Compilation is lazy (it happens inside the first forward and, for inductor, the first
backward), so the engine cannot time it around ``torch.compile``. Instead:

* every compiled module's call goes through a `TrackedCall`, which pushes the component's name
  while the compiled code runs (so a failure there is attributed, and calls are counted);
* dynamo's compile start/end callbacks (``torch._dynamo.callback_handler``, torch >= 2.5) time
  each compile and read dynamo's counters (``unique_graphs``, FX graph / AOTAutograd cache hits
  and misses) before and after. Dynamo compiles run in the calling thread, so the pushed name
  is the component being compiled. Lazy backward compiles carry the forward's compile id,
  which maps back to its component.
* A recompile is a dynamo compile whose id is ``frame/attempt`` with attempt > 0; its reasons
  are the guard failures dynamo recorded (``torch._dynamo.utils.guard_failures``) since the
  previous compile.

The callbacks are registered by `install` and removed by `uninstall` (never at import).
"""
from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


@dataclass
class ComponentStats:
    calls: int = 0                # calls into compiled modules
    calls_after_graph: int = 0    # ... once a graph existed for the component
    graphs: int = 0
    compiles: int = 0             # dynamo + lazy backward compiles
    compile_seconds: float = 0.0
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    cache_hits: int = 0
    cache_misses: int = 0
    recompile_limit_hits: int = 0  # frames dynamo gave up on: those calls ran eager
    late_recompiles: int = 0       # recompiles after warm-up at shapes already trained

    @property
    def compiled_code_ran(self) -> bool:
        return self.calls_after_graph > 0


def _counter_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "hits": counters["inductor"]["fxgraph_cache_hit"]
        + counters["aot_autograd"]["autograd_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_miss"],
    }


def _recompile_limit_hits() -> int:
    """How often dynamo hit a recompile limit (it then runs that frame eager, with a warning)."""
    from torch._dynamo.utils import counters

    return sum(count for message, count in counters["unimplemented"].items()
               if "recompile limit" in str(message).lower())


def _guard_failure_count() -> int:
    from torch._dynamo.utils import guard_failures

    return sum(len(reasons) for reasons in guard_failures.values())


def _guard_failures_since(seen: int) -> list[str]:
    from torch._dynamo.utils import guard_failures

    every = [reason for reasons in guard_failures.values() for reason in reasons]
    return every[seen:]


class CompileTracker:
    """Per-component compile statistics, fed by `TrackedCall` and dynamo's compile callbacks."""

    def __init__(self, on_graph: Callable[[str, ComponentStats, float], None] | None = None,
                 on_recompile: Callable[[str, ComponentStats, list[str]], None] | None = None,
                 on_limit: Callable[[str, ComponentStats], None] | None = None):
        self.stats: dict[str, ComponentStats] = {}
        self.on_graph = on_graph
        self.on_recompile = on_recompile
        self.on_limit = on_limit
        self._active: list[str] = []
        self._limit_hits_before: list[int] = []
        self._compiling: str | None = None
        self._compile_started = 0.0
        self._before: dict[str, int] = {}
        self._compile_ids: dict[str, str] = {}
        self._guard_failures_seen = 0
        self.last_failure: str | None = None
        self.paused = False  # calls run with compiled code bypassed (sampling) are not counted
        self._compile_errors: list[BaseException] = []  # raised inside a dynamo compile
        self._installed = False

    def component(self, name: str) -> ComponentStats:
        return self.stats.setdefault(name, ComponentStats())

    def compile_counts(self) -> dict[str, int]:
        """Compiles so far per component (dynamo and lazy backward; failed ones included)."""
        return {name: stats.compiles for name, stats in self.stats.items()}

    def raised_while_compiling(self, err: BaseException) -> bool:
        """Whether ``err`` (or an exception it wraps) escaped from inside a dynamo compile."""
        from modules.util.errors import error_chain

        seen = {id(e) for e in self._compile_errors}
        return any(id(e) in seen for e in error_chain(err))

    # -- TrackedCall side -------------------------------------------------------------------
    def enter(self, name: str) -> None:
        if self.paused:
            return
        self._active.append(name)
        self._limit_hits_before.append(_recompile_limit_hits())
        self.component(name).calls += 1

    def leave(self, name: str) -> None:
        if self.paused:
            return
        self._active.pop()
        new_limit_hits = _recompile_limit_hits() - self._limit_hits_before.pop()
        stats = self.component(name)
        if new_limit_hits > 0:
            stats.recompile_limit_hits += new_limit_hits
            if self.on_limit is not None:
                self.on_limit(name, stats)
        elif stats.graphs > 0:
            stats.calls_after_graph += 1

    def note_failure(self, name: str) -> None:
        if self.last_failure is None:  # the innermost compiled module that failed wins
            self.last_failure = name

    # -- dynamo callbacks -------------------------------------------------------------------
    def install(self) -> None:
        import torch._dynamo

        if not self._installed:
            torch._dynamo.callback_handler.register_start_callback(self._on_start)
            torch._dynamo.callback_handler.register_end_callback(self._on_end)
            self._guard_failures_seen = _guard_failure_count()
            self._installed = True

    def uninstall(self) -> None:
        import torch._dynamo

        handler = torch._dynamo.callback_handler
        # someone else's torch._dynamo.reset() may already have cleared them
        if self._on_start in handler.start_callbacks:
            handler.remove_start_callback(self._on_start)
        if self._on_end in handler.end_callbacks:
            handler.remove_end_callback(self._on_end)
        self._installed = False

    def after_dynamo_reset(self) -> None:
        """``torch._dynamo.reset()`` restarts compile ids, clears guard failures and removes
        every compile callback (``callback_handler.clear()``), so ours are registered again.
        The compile errors kept for `raised_while_compiling` are let go: their tracebacks hold
        the failed compile's inputs, which a retry needs the memory of."""
        self._compile_ids.clear()
        self._compile_errors = []
        if self._installed:
            self._installed = False
            self.install()
        self._guard_failures_seen = _guard_failure_count()

    def _owner(self, args: Any) -> str | None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger == CallbackTrigger.DYNAMO:
            return self._active[-1] if self._active else None
        return self._compile_ids.get(str(args.compile_id))

    def _on_start(self, args: Any) -> None:
        self._compiling = self._owner(args)
        self._compile_started = time.perf_counter()
        self._before = _counter_snapshot()

    def _on_end(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        name, self._compiling = self._compiling, None
        # The end callbacks run in a ``finally``: an exception in flight is the compile's own.
        in_flight = sys.exc_info()[1]
        if in_flight is not None:
            self._compile_errors = [*self._compile_errors[-7:], in_flight]
        if name is None:
            return
        seconds = time.perf_counter() - self._compile_started
        after = _counter_snapshot()
        stats = self.component(name)
        stats.compiles += 1
        stats.compile_seconds += seconds
        stats.graphs += after["graphs"] - self._before["graphs"]
        stats.cache_hits += after["hits"] - self._before["hits"]
        stats.cache_misses += after["misses"] - self._before["misses"]
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            compile_id = str(args.compile_id)
            self._compile_ids[compile_id] = name
            match = _COMPILE_ID.search(compile_id)
            reasons = _guard_failures_since(self._guard_failures_seen)
            self._guard_failures_seen += len(reasons)
            if match and int(match.group(2)) > 0:
                stats.recompiles += 1
                # dynamo records one reason per cache entry it tried; the newest few are kept
                stats.recompile_reasons.extend(reasons[-3:])
                if self.on_recompile is not None:
                    self.on_recompile(name, stats, reasons)
        if self.on_graph is not None:
            self.on_graph(name, stats, seconds)


class TrackedCall:
    """Stands in for a module's ``_compiled_call_impl``: same call, attributed to a component."""

    def __init__(self, compiled: Callable[..., Any], tracker: CompileTracker, component: str):
        self.compiled = compiled
        self.tracker = tracker
        self.component = component

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tracker.enter(self.component)
        try:
            return self.compiled(*args, **kwargs)
        except Exception:
            self.tracker.note_failure(self.component)
            raise
        finally:
            self.tracker.leave(self.component)
