"""Check Gyre's traffic to SGLang with SGLang itself: run by the SGLang check venv's python.

    .tools/sglang-check/bin/python tools/sglang_check.py < job.json > report.json
    .tools/sglang-check/bin/python tools/sglang_check.py --serve   # a job per line, a report
                                                                  # per line (one import)

Runs inside the virtual environment `tools/install_sglang_check.sh` makes (the pinned SGLang
release without its GPU dependencies) and imports only the standard library and SGLang, so
it judges Gyre by SGLang's code, not by Gyre's. The job (JSON on stdin) holds the requests
Gyre sent (`{"method", "route", "body"}`), the sglang launch preset's argv (after
`-m sglang.launch_server`) with the values expected from SGLang's parser, the
environment variables Gyre sets, and request type names. The report (JSON on stdout) has,
per request, `errors` (empty when SGLang would take it) and, for
`/update_weights_from_tensor`, the tensors SGLang's own `MultiprocessingSerializer.
deserialize` reads from the payload; per launch argv, its errors; per environment variable,
the SGLang source files that read it; per request type, its fields.

A request is checked as SGLang's HTTP server takes it (`sglang/srt/entrypoints/
http_server.py`, read as source: importing it needs uvloop and the serving stack): the route
and method must exist; the body must validate as the endpoint's request type (pydantic's
`TypeAdapter`, the path FastAPI takes, which accepts and drops unknown fields, so every
field must also be one of the type's own); `/generate`'s `sampling_params` must build and
`verify` as SGLang's `SamplingParams`. The launch argv is parsed by `ServerArgs.add_cli_args`.

`torchvision` is replaced by an empty stand-in before SGLang is imported: SGLang's config
package imports it at module level (multimodal processors), and no torchvision wheel for
the CPU build of torch 2.13 exists on PyPI (its wheels link libtorch_cuda). Request types
and the argument parser do not use it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any
from unittest import mock


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of `torchvision` (and its submodules) get a mock module."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module: Any) -> None:
        pass


def _stub_torchvision() -> None:
    """transformers asks importlib.metadata for torchvision's version: give it one."""
    dist = Path(tempfile.mkdtemp()) / "torchvision-0.28.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    sys.path.insert(0, str(dist.parent))
    sys.meta_path.insert(0, _Stub())


def routes(http_server: Path) -> dict[tuple[str, str], str | None]:
    """(method, path) -> name of the request type of its body (None: no body)."""
    table: dict[tuple[str, str], str | None] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body_type = _body_type(node)
        for deco in node.decorator_list:
            for method, path in _route(deco):
                table[(method, path)] = body_type
    return table


def _route(deco: ast.expr) -> list[tuple[str, str]]:
    if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
        return []
    if not (isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
        return []
    if not (deco.args and isinstance(deco.args[0], ast.Constant)):
        return []  # a path from the environment
    path, kind = str(deco.args[0].value), deco.func.attr
    if kind in ("get", "post", "put", "delete"):
        return [(kind.upper(), path)]
    if kind == "api_route":
        methods = next((k.value for k in deco.keywords if k.arg == "methods"), None)
        if isinstance(methods, ast.List):
            return [(str(ast.literal_eval(m)), path) for m in methods.elts]
    return []


def _body_type(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The request type of the endpoint's `obj` parameter (plain or Annotated[T, Body()])."""
    for arg in fn.args.args:
        if arg.arg != "obj" or arg.annotation is None:
            continue
        names = [n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)]
        found = [n for n in names if n.endswith(("ReqInput", "Req", "Request"))]
        return found[0] if found else None
    return None


def field_names(cls: Any) -> set[str]:
    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name for f in msgspec.structs.fields(cls)}
    return {f.name for f in dataclasses.fields(cls)}


def check_request(req: dict[str, Any], table: dict[tuple[str, str], str | None]) -> dict[str, Any]:
    import pydantic
    from sglang.srt.managers import io_struct

    out: dict[str, Any] = {"route": req["route"], "method": req["method"], "errors": []}
    key = (req["method"], req["route"])
    if key not in table:
        out["errors"].append(f"SGLang has no route {req['method']} {req['route']}")
        return out
    name, body = table[key], req["body"]
    out["type"] = name
    if name is None or body is None:
        return out
    cls = getattr(io_struct, name, None)
    if cls is None:
        out["errors"].append(f"request type {name} not found in io_struct")
        return out
    unknown = sorted(set(body) - field_names(cls))
    if unknown:
        out["errors"].append(f"{name} has no field {', '.join(unknown)} (SGLang drops it)")
    try:
        obj = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
    except pydantic.ValidationError as e:
        out["errors"].append(f"{name}: {e}")
        return out
    if name == "GenerateReqInput":
        out["errors"] += _check_sampling(body.get("sampling_params") or {})
    if name == "UpdateWeightsFromTensorReqInput":
        out["errors"] += _check_tensor_update(obj, out)
    return out


# load_format values SGLang's weight updater takes without a custom loader (else it raises
# NotImplementedError): model_executor/model_runner_components/weight_updater.py
TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")


def _check_tensor_update(obj: Any, out: dict[str, Any]) -> list[str]:
    if obj.load_format not in TENSOR_LOAD_FORMATS:
        return [f"load_format {obj.load_format!r}: SGLang's weight updater refuses it"]
    try:
        out["tensors"] = _read_tensors(obj)
    except Exception as e:
        return [f"MultiprocessingSerializer.deserialize: {type(e).__name__}: {e}"]
    return []


def _check_sampling(params: dict[str, Any]) -> list[str]:
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        SamplingParams(**params).verify(vocab_size=1 << 20)
    except (TypeError, ValueError) as e:
        return [f"SamplingParams: {e}"]
    return []


def _read_tensors(obj: Any) -> list[list[Any]]:
    """What SGLang's deserializer reads from each rank's payload: [rank, name, dtype, shape,
    values]. A flattened_bucket payload is handed to SGLang's own loader
    (`WeightUpdater._update_weights_from_flattened_bucket`, its records converted and the
    bucket reconstructed by SGLang's code) with a model that records what it is given."""
    from sglang.srt.utils import MultiprocessingSerializer

    out = []
    for rank, payload in enumerate(obj.serialized_named_tensors):
        data = MultiprocessingSerializer.deserialize(payload)
        named = _bucket_tensors(data) if obj.load_format == "flattened_bucket" else data
        for tensor_name, t in named:
            values = t.double().flatten().tolist()
            out.append([rank, tensor_name, str(t.dtype), list(t.shape), values])
    return out


def _bucket_tensors(data: Any) -> list[Any]:
    from sglang.srt.model_executor.model_runner_components import weight_updater

    loaded: list[Any] = []

    class _Model:
        def load_weights(self, named: Any) -> None:
            loaded.extend(named)

    class _Runner:  # what the loader reads of its WeightUpdater
        def get_model(self) -> _Model:
            return _Model()

    ok, message = weight_updater.WeightUpdater._update_weights_from_flattened_bucket(
        _Runner(), flattened_tensor_bucket_dict=data
    )
    if not ok:
        raise ValueError(message)
    return loaded


def check_launch(argv: list[str], expect: dict[str, Any]) -> list[str]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        ns, extra = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        return [f"launch flags: {e}"]
    errors = [f"launch flags: SGLang does not know {extra}"] if extra else []
    for key, value in expect.items():
        if getattr(ns, key, None) != value:
            errors.append(f"launch flags: {key} = {getattr(ns, key, None)!r}, expected {value!r}")
    return errors


def env_readers(names: typing.Iterable[str], package: Path) -> dict[str, list[str]]:
    """The SGLang source files that read each environment variable."""
    found: dict[str, list[str]] = {n: [] for n in names}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(errors="replace")
        for n in found:
            if f'"{n}"' in text or f"{n}:" in text:
                found[n].append(str(path.relative_to(package.parent)))
    return found


def fields(names: typing.Iterable[str]) -> dict[str, list[str]]:
    """The fields of each of SGLang's request types (`sglang.srt.managers.io_struct`)."""
    import msgspec
    from sglang.srt.managers import io_struct

    return {n: [f.name for f in msgspec.structs.fields(getattr(io_struct, n))] for n in names}


def check(job: dict[str, Any], package: Path, table: Any) -> dict[str, Any]:
    """The report on one job."""
    from sglang.version import __version__

    return {
        "sglang": __version__,
        "requests": [check_request(r, table) for r in job.get("requests", [])],
        "launch": [check_launch(item["argv"], item["expect"]) for item in job.get("launch", [])],
        "env": env_readers(job.get("env", []), package),
        "fields": fields(job.get("fields", [])),
    }


def main(argv: list[str]) -> int:
    """One job on stdin, its report on stdout; with --serve, a job per line, a report per line
    until stdin closes (SGLang's modules are imported once for them all)."""
    if argv not in ([], ["--serve"]):
        print(f"sglang_check: {argv!r}; allowed: no argument, or --serve", file=sys.stderr)
        return 2
    _stub_torchvision()
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    table = routes(package / "srt" / "entrypoints" / "http_server.py")
    if argv == ["--serve"]:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(check(json.loads(line), package, table)), flush=True)
        return 0
    json.dump(check(json.load(sys.stdin), package, table), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
