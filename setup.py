"""Build libgemhook.so.1 (plain C, no Python or CUDA linkage) into the package at install time."""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithHook(build_py):
    def run(self):
        super().run()
        subprocess.check_call(["make", "-C", str(ROOT), "hook"])
        built = ROOT / "gemini" / "lib" / "libgemhook.so.1"
        headers = [ROOT / "hook" / "gemini_proto.h", ROOT / "hook" / "board.h"]
        if not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / "gemini"
            (target / "lib").mkdir(parents=True, exist_ok=True)
            (target / "hook_include").mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target / "lib" / built.name)
            for header in headers:
                shutil.copy2(header, target / "hook_include" / header.name)
            os.chmod(target / "lib" / built.name, 0o755)


setup(cmdclass={"build_py": BuildWithHook})
