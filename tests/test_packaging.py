"""The distribution installs one top-level import name, cula_serve; the demo runs end to end."""
import os
import subprocess
import sys

import cula_serve


def test_only_cula_serve_is_importable(tmp_path):
    # run from an empty folder so the source checkout is not on sys.path
    code = ("import importlib.util as u, cula_serve.kernels, cula_serve.integrations;"
            "print(u.find_spec('kernels'), u.find_spec('integrations'), cula_serve.kernels.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "None", "cula_serve.kernels"]


def test_public_api():
    for name in ("cula_gdn", "cula_kda", "cula_lightning", "cula_decode", "cula_verify", "cula_commit", "StatePool"):
        assert callable(getattr(cula_serve, name))
        assert getattr(cula_serve, name).__doc__


def test_demo_runs_and_checks_itself(tmp_path):
    env = {**os.environ, "CULA_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-m", "cula_serve", "demo", "--mode", "gdn"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all errors within" in out.stdout
