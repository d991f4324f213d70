"""The shared vLLM virtualenv holds nothing of one checkout (issue 20, test hygiene).

* The environment Kairos gives a vLLM server (``kairos/engines/vllm/launch.py`` ``VllmServer.env``)
  puts the checkout whose ``kairos`` package was imported first on ``PYTHONPATH``: two checkouts
  give two different environments, each naming itself (the engine imports the scheduler plugin from
  there, never from whatever the venv happens to point at).
* ``make vllm-venv`` writes nothing of the checkout into the venv (Makefiles before issue 20 wrote a
  ``kairos-repo.pth`` naming the checkout that ran last) and removes such a file left by an older
  Makefile. Run for real against a throw-away venv whose ``pip`` only logs its arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: run in a fresh interpreter whose PYTHONPATH starts with one checkout: the env of a server it would launch
ENV_PROBE = """
import json, kairos
from kairos.engines.vllm.launch import VllmServer
srv = VllmServer(node="decode-0", role="decode", model_dir="/m", served_model="tiny", port=1, state_addr="ipc:///s",
                 nixl_port=2, ucx_ports="3-4")
print(json.dumps({"kairos": kairos.__file__, "env": srv.env({"PYTHONPATH": "/elsewhere", "PATH": "/usr/bin"}),
                  "argv": srv.argv("/venv/bin/python")}))
"""


def checkout_copy(root: Path) -> Path:
    """A second checkout's ``kairos`` package at ``root/kairos`` (a copy: a symlink would resolve back here)."""
    shutil.copytree(REPO / "kairos", root / "kairos", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def server_env(checkout: Path, cwd: Path) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONPATH": str(checkout), "HOME": str(cwd)}
    out = subprocess.run([sys.executable, "-c", ENV_PROBE], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_vllm_server_launched_from_each_checkout_imports_that_checkout(tmp_path):
    a, b = checkout_copy(tmp_path / "clone-a"), checkout_copy(tmp_path / "clone-b")
    seen = {}
    for name, root in (("a", a), ("b", b)):
        got = server_env(root, tmp_path)
        assert Path(got["kairos"]).resolve().is_relative_to(root.resolve()), got["kairos"]  # the probe ran that copy
        path = got["env"]["PYTHONPATH"].split(os.pathsep)
        assert Path(path[0]).resolve() == root.resolve(), path  # the checkout first ...
        assert path[-1] == "/elsewhere"  # ... the caller's own PYTHONPATH kept after it
        assert all(not p.startswith(str(REPO)) for p in path), path  # nothing of the checkout that runs the test
        assert got["argv"][:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        seen[name] = path[0]
    assert seen["a"] != seen["b"]


def _fake_venv(root: Path) -> tuple[Path, Path]:
    """A venv without pip (``python -m venv --without-pip``) plus a ``bin/pip`` that only logs; returns
    (venv, its purelib directory)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    pip = root / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$@" >> "{root / "pip.log"}"\n')
    pip.chmod(0o755)
    purelib = subprocess.run([str(root / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return root, Path(purelib)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_vllm_venv_writes_nothing_of_the_checkout_into_the_venv(tmp_path):
    venv, purelib = _fake_venv(tmp_path / "vllm-venv")
    stale = purelib / "kairos-repo.pth"
    stale.write_text("/some/other/clone\n")  # what an older Makefile left there
    before = _files(venv)
    out = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "vllm-venv", f"VLLM_VENV={venv}",
                          f"PY={sys.executable}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (venv / "pip.log").is_file(), "the target did not run its pip steps"  # it really ran
    after = _files(venv)
    assert not stale.exists(), "the stale kairos-repo.pth of an older Makefile is still there"
    new = set(after) - set(before) - {".kairos-installed", "pip.log"}
    assert not new, f"make vllm-venv wrote {sorted(new)} into the shared venv"
    changed = [f for f in set(after) & set(before) if after[f] != before[f] and f != "pip.log"]
    assert not changed, changed
    assert "removed" in out.stdout and "kairos-repo.pth" in out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_leaves_a_pth_that_is_not_the_old_makefiles_alone(tmp_path):
    """Only the one-line, absolute-path file the old target wrote is removed, nothing a user put there."""
    venv, purelib = _fake_venv(tmp_path / "vllm-venv")
    mine = purelib / "kairos-repo.pth"
    mine.write_text("import os\n/a\n")
    out = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "vllm-venv", f"VLLM_VENV={venv}",
                          f"PY={sys.executable}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert mine.read_text() == "import os\n/a\n"
