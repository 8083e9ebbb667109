"""The GPU image's packages on this machine: a top-level import the image could not serve fails.

tools/gpu_check.py's CPU rehearsal puts this directory first on PYTHONPATH of `gyre run` and
every process it starts (MPI ranks, engines), with GYRE_IMAGE_ALLOWED naming the top-level
modules the device machine has (its image's, and those of the wheels tools/gpu_check.sh
carries) and GYRE_IMAGE_CHECKED the packages whose imports are checked (Gyre and the carried
ones). A top-level module outside the allowed list and the standard library, imported by a
checked package, raises ModuleNotFoundError here as it would there (code that treats the
package as optional goes on as it would there), and is appended to GYRE_IMAGE_BLOCKED (a
file), so the rehearsal names every package the GPU check would miss. What the image's own
packages (torch, transformers) import is theirs and passes.
"""

from __future__ import annotations

import os
import sys

_ALLOWED = frozenset(filter(None, os.environ.get("GYRE_IMAGE_ALLOWED", "").split(",")))
_CHECKED = frozenset(filter(None, os.environ.get("GYRE_IMAGE_CHECKED", "").split(",")))
_LOG = os.environ.get("GYRE_IMAGE_BLOCKED", "")


def _importer() -> str:
    """The top-level package of the module whose code runs the import."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name and not name.startswith("importlib") and name != __name__:
            return str(name).split(".")[0]
        frame = frame.f_back
    return ""


class _ImageGuard:
    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> None:
        if "." in fullname or fullname in _ALLOWED or fullname in sys.stdlib_module_names:
            return None
        importer = _importer()
        if fullname.startswith("_") or importer not in _CHECKED:
            return None  # private extension modules; what other packages import is theirs
        if _LOG:
            with open(_LOG, "a") as log:
                log.write(f"{fullname} (imported by {importer})\n")
        raise ModuleNotFoundError(f"No module named {fullname!r} (not on the GPU image)",
                                  name=fullname)  # fmt: skip


if _ALLOWED:
    sys.meta_path.insert(0, _ImageGuard())
