"""``shardps train`` without the apps extra: a clear error naming the install command, in a real process."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import REPO

# sys.modules[name] = None makes the package unimportable in that process, as if it were not installed
SCRIPT = ("import sys; sys.modules['sklearn'] = None; "
          "from shardps.cli.main import main; sys.exit(main(['train', 'digits', '--no-progress']))")


def test_train_without_the_apps_extra_names_the_install_command() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "needs the apps extra (sklearn missing)" in run.stderr and "shardps[apps]" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
