"""gemini's sitecustomize: PyTorch's cache freed before each eviction of a unified group, in an unmodified program.

launch-command --torch-empty-cache-on-evict puts this directory first on PYTHONPATH and sets
GEMINI_TORCH_EMPTY_CACHE_ON_EVICT=1. Python imports this file at start-up (site.py); it
  - runs the sitecustomize this one hides (the next one on sys.path), as site.py would have;
  - and, only if that variable is 1, waits for `import torch`: a finder on sys.meta_path sees the first import
    of torch and, once torch has finished loading, loads gemini/unified_torch.py by its path (the program's Python
    need not have gemini installed) and calls install(). A program that never imports torch gets no thread, no
    symbol lookup, nothing but this finder's name check on each new top-level import.
Errors are reported on stderr as site.py reports a failing sitecustomize, and never stop the program.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import traceback

ENV = "GEMINI_TORCH_EMPTY_CACHE_ON_EVICT"
_HERE = os.path.dirname(os.path.abspath(__file__))
_MODULE = os.path.join(os.path.dirname(_HERE), "unified_torch.py")


def _report(what):
    sys.stderr.write(f"gemini sitecustomize: {what}:\n{traceback.format_exc()}")


def _install_delegate():
    try:
        spec = importlib.util.spec_from_file_location("_gemini_unified_torch", _MODULE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module.install()
    except Exception:   # noqa: BLE001 -- never stop the program
        _report(f"the eviction delegate ({_MODULE}) could not be installed")


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the first import of torch, asks the finders after it for torch's spec and makes
    its loader install the delegate once torch's module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)      # once; and the finders below must not find this one again
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_then_install(module):
            run(module)
            _install_delegate()

        try:
            loader.exec_module = exec_then_install     # this spec's own loader instance (a SourceFileLoader)
        except (AttributeError, TypeError):
            _report("cannot watch torch's import (its loader is read-only): no eviction delegate")
        return spec


def _chain():
    """Run the sitecustomize this file hides, the next one on sys.path."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception:   # noqa: BLE001 -- as site.py treats a failing sitecustomize
        _report("the next sitecustomize on the path failed")


if os.environ.get(ENV) == "1" and "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorch())
elif os.environ.get(ENV) == "1":
    _install_delegate()
_chain()
