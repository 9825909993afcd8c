"""The documented pip install path and the typing of the `kvt` package: gen_protos.py generates
the stubs into a copy of clients/python, pip installs it into a fresh target directory, and the
installed package (with py.typed and the .pyi stubs) imports from there; mypy (the project
venv's, configured in pyproject.toml) finds no type errors in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from kvt_testing import junit_main
from kvt_testing.runfiles import runfile, test_tmpdir


def package_sources() -> str:
    return os.path.dirname(runfile("clients/python/pyproject.toml"))


class PackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.work = tempfile.mkdtemp(dir=test_tmpdir())
        cls.pkg = os.path.join(cls.work, "python")
        source = package_sources()
        for name in ("pyproject.toml", "README.md", "gen_protos.py"):
            os.makedirs(cls.pkg, exist_ok=True)
            shutil.copyfile(os.path.join(source, name), os.path.join(cls.pkg, name))
        # The package and its subpackages (kvt.vllm: the vLLM connector).
        for sub in ("kvt", os.path.join("kvt", "vllm")):
            os.makedirs(os.path.join(cls.pkg, sub))
            for name in os.listdir(os.path.join(source, sub)):
                if name.endswith(".py") or name == "py.typed":
                    shutil.copyfile(os.path.join(source, sub, name),
                                    os.path.join(cls.pkg, sub, name))
        # The README's generation step, with the checkout's protos (from the runfiles).
        repo_root = os.path.normpath(os.path.join(
            os.path.dirname(runfile("proto/kvt/v1/service.proto")), "..", "..", ".."))
        subprocess.run([sys.executable, os.path.join(cls.pkg, "gen_protos.py"),
                        f"--repo_root={repo_root}"], check=True)

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.work, ignore_errors=True)

    def test_pip_install_and_import(self) -> None:
        site = os.path.join(self.work, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-build-isolation", "--target", site, self.pkg], check=True,
                       cwd=self.work)
        for path in ("kvt/py.typed", "kvt/_proto/translate_pb2.pyi",
                     "kvt/_proto/service_pb2_grpc.py", "kvt/adapters.py",
                     "kvt/vllm/connector.py"):
            self.assertTrue(os.path.isfile(os.path.join(site, path)), path)
        probe = ("import kvt, kvt._proto.service_pb2_grpc as s; "
                 "print(kvt.__file__); print(s.KvTranslatorStub.__name__, kvt.__version__)")
        out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                             text=True, cwd=self.work, env={**os.environ, "PYTHONPATH": site})
        self.assertEqual(out.stdout.splitlines(),
                         [os.path.join(site, "kvt", "__init__.py"), "KvTranslatorStub 0.1.0"])

    def test_mypy_finds_no_type_errors(self) -> None:
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                              os.path.join(self.pkg, "pyproject.toml"), "kvt"],
                             capture_output=True, text=True, cwd=self.pkg)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Success: no issues found", out.stdout)


if __name__ == "__main__":
    junit_main.main()
