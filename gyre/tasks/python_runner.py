"""Call a task's Python reward function on a workspace copy and write a JSON result file.

Standalone (standard library only) so the `python` scoring rule can run it with `python -I`
in a scratch copy of the preserved workspace, with the minimal scoring environment:

    python -I python_runner.py --function /abs/reward.py:score --workspace /tmp/scratch \
        --data /tmp/data.json --result /tmp/result.json

The function is called as `fn(workspace: pathlib.Path, data: dict)`; `data` is the task's
data (a data-suite row's extra fields). With `--transcript FILE` (a task with
`scoring.transcript: true`) it is called as `fn(workspace, data, transcript)`, the
execution's transcript read from that JSON file. The result file holds `{"returned": <value>}`, or
`{"error": "<what went wrong>"}` when the file does not import, the function raises or its
value is not JSON. Checking the value (a score in [0, 1] or a `{score, detail, critique}`
mapping) is the evaluator's job (`gyre.tasks.scoring.python`), not this script's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def load_function(spec: str) -> Any:
    """The callable named by `path.py:name` (its directory first on `sys.path`)."""
    file, _, name = spec.rpartition(":")
    path = Path(file)
    sys.path.insert(0, str(path.parent))
    module_spec = importlib.util.spec_from_file_location(f"gyre_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {file!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path.name} defines no function {name!r}")
    return fn


def call(spec: str, workspace: Path, data: dict[str, Any], *more: Any) -> dict[str, Any]:
    """`{"returned": value}` of the reward function called with (workspace, data, *more), or
    `{"error": ...}` if it failed."""
    try:
        returned = load_function(spec)(workspace, data, *more)
    except BaseException as e:  # any failure of the reward function (SystemExit included)
        tail = "".join(traceback.format_exception(e)[-3:])
        return {"error": f"{type(e).__name__}: {str(e)[:300]}\n{tail[-1000:]}"}
    try:
        json.dumps(returned, allow_nan=False)
    except (TypeError, ValueError) as e:
        return {"error": f"it returned {returned!r:.200}, which is not JSON ({e})"}
    return {"returned": returned}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--function", required=True)
    ap.add_argument("--workspace", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--transcript", type=Path)
    ap.add_argument("--result", required=True, type=Path)
    args = ap.parse_args(argv)
    result_path = args.result.resolve()
    data = json.loads(args.data.read_text())
    more = [json.loads(args.transcript.read_text())] if args.transcript else []
    result = call(args.function, args.workspace.resolve(), data, *more)
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(3)
