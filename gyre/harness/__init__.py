"""Harness runner, adapters and Gyre's reference agent.

A harness is an unmodified agent program (Claude Code, the reference agent, ...) run as a
subprocess in its own fresh workspace against the proxy; the runner supervises it (time
budget, cancellation, process-group kill) and reports `Launched` / `Terminated` events:

    runner = HarnessRunner(HarnessRunner.Config(workspace_root="runs/ws"), on_event=print)
    terminated = await runner.run(ExecutionSpec(execution_id="e0", task=task,
        adapter=get_adapter("reference"), proxy_url=url, api_key=key, model="tiny"))

See docs/harness.md.
"""

from typing import TYPE_CHECKING

from gyre.lazy import lazy_exports

if TYPE_CHECKING:
    from gyre.harness.adapters import Adapter, builtin_adapters, get_adapter, load_adapters
    from gyre.harness.events import HarnessEvent, Launched, Terminated
    from gyre.harness.runner import ExecutionSpec, HarnessRunner

# imported on first use: a harness process (the reference agent) needs none of them
__getattr__, __dir__ = lazy_exports(globals(), {
    **dict.fromkeys(("Adapter", "builtin_adapters", "get_adapter", "load_adapters"),
                    "gyre.harness.adapters"),
    **dict.fromkeys(("HarnessEvent", "Launched", "Terminated"), "gyre.harness.events"),
    **dict.fromkeys(("ExecutionSpec", "HarnessRunner"), "gyre.harness.runner"),
})  # fmt: skip

__all__ = [
    "Adapter",
    "ExecutionSpec",
    "HarnessEvent",
    "HarnessRunner",
    "Launched",
    "Terminated",
    "builtin_adapters",
    "get_adapter",
    "load_adapters",
]
