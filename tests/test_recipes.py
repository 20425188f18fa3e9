"""The CPU smoke recipe runs end to end in CI: new-model -> distill -> profile -> generate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_recipe(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "recipes/cpu_smoke.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ar", "chain", "stree")}
    assert runs["chain"]["token_ids"] == runs["ar"]["token_ids"] == runs["stree"]["token_ids"]
    assert runs["stree"]["stats"]["new_tokens"] == 48
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert "fits" in profile and (tmp_path / "profile" / "profile.png").stat().st_size > 0
    assert (tmp_path / "drafter" / "config.json").exists()


def test_recipes_call_only_ssmspec_and_are_strict():
    for recipe in (ROOT / "recipes").glob("*.sh"):
        text = recipe.read_text()
        assert "set -euo pipefail" in text, recipe
        commands = [line.strip().split()[0] for line in text.splitlines()
                    if line.strip() and not line.strip().startswith(("#", "echo", "set ", "work=", "data=", "prompt=", "mkdir"))
                    and not line.startswith(" ")]
        assert all(c == "ssmspec" for c in commands), (recipe, commands)
