"""The README's quick start runs verbatim: its ```bash block, in a fresh directory, under `bash -euo pipefail`."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_block(text: str) -> str:
    """The first ```bash block after the heading that contains 'Quick start'."""
    heading = re.search(r"^#+ .*Quick start.*$", text, flags=re.MULTILINE | re.IGNORECASE)
    assert heading, "README.md has no 'Quick start' heading"
    block = re.compile(r"^```bash\n(.*?)^```", flags=re.MULTILINE | re.DOTALL).search(text, heading.end())
    assert block, "README.md has no ```bash block after its 'Quick start' heading"
    return block.group(1)


def test_quick_start_block_is_found():
    script = quick_start_block(README.read_text())
    assert script.splitlines()[0].startswith("ssmspec new-model") and "ssmspec generate" in script


def test_readme_quick_start_runs_verbatim(tmp_path):
    script = quick_start_block(README.read_text())
    (tmp_path / "quick_start.sh").write_text(script)
    bin_dir = Path(sys.executable).parent  # the venv's bin: `ssmspec` as a user's shell finds it
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    env.pop("SSMSPEC_DEBUG", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "quick_start.sh"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert (tmp_path / "runs" / "target" / ".ssmspec-output").is_file()
    assert (tmp_path / "runs" / "profile" / "profile.json").is_file()
    assert '"token_ids"' in proc.stdout  # the --json generation printed its object
