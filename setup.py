"""Build libgemhook.so.1 (plain C, no Python or CUDA linkage) into the package at install time.

The library and the wire headers are build outputs, not package data: `make hook` writes gemini/lib/libgemhook.so.1
in the source tree (where an editable install and the tests find it), and a wheel gets both files copied into its
build directory here. Declaring them as package data would make setuptools treat gemini/lib as a package.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
HOOK = ROOT / "gemini" / "lib" / "libgemhook.so.1"
# Where each lands inside the installed gemini package (gemini/hookpath.py, gemini/wire/hook.py and gemini/board.py
# look there): the library, and the headers whose cffi regions Python reads.
SHIPPED = {HOOK: Path("lib") / HOOK.name,
           **{ROOT / "hook" / h: Path("hook_include") / h for h in ("gemini_proto.h", "board.h")}}


class BuildWithHook(build_py):
    def run(self):
        super().run()
        subprocess.check_call(["make", "-s", "-C", str(ROOT), "hook"])
        if getattr(self, "editable_mode", False):
            return      # the source tree is the package: gemini/lib/ and hook/ are found in place
        for src, rel in SHIPPED.items():
            target = Path(self.build_lib) / "gemini" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        os.chmod(Path(self.build_lib) / "gemini" / SHIPPED[HOOK], 0o755)
        self._cffi_modules()

    def _cffi_modules(self):
        """The headers' cffi declarations as modules (gemini/wire/cdefs.py), so that the installed daemons need
        not parse them at every start. Only a shortcut: skipped where the build has no cffi."""
        try:
            import cffi  # noqa: F401
        except ImportError:
            return
        target = Path(self.build_lib) / "gemini" / "wire" / "_cdefs"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([self.build_lib, *filter(None, [os.environ.get(
            "PYTHONPATH")])]))
        subprocess.call([sys.executable, "-m", "gemini.wire.cdefs", "--out", str(target)], env=env)
        self._cffi_outputs = [str(p) for p in target.glob("*.py")]

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs += [str(Path(self.build_lib) / "gemini" / rel) for rel in SHIPPED.values()]
            outputs += getattr(self, "_cffi_outputs", [])
        return outputs


class NativeDistribution(Distribution):
    """The package holds a native library: it installs as platform-specific (platlib)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Tag the wheel py3-none-<platform>: the library is built for this machine but has no libpython in it,
    so any Python 3 there can use it."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildWithHook, "bdist_wheel": PlatformWheel})
