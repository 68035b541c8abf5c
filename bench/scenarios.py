"""The benchmark prompts live in prefixkv/scenarios.py (the demo uses them too). This shim loads
that file by path, so peer drivers running in another engine's venv - without prefixkv
installed - import the very same prompts with `import scenarios`."""
import importlib.util as _util
import pathlib as _pathlib
import sys as _sys

_spec = _util.spec_from_file_location(
    "_prefixkv_scenarios", _pathlib.Path(__file__).resolve().parent.parent / "prefixkv" / "scenarios.py")
_module = _util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_sys.modules[__name__].__dict__.update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
