"""The type checker (mypy, configured in pyproject.toml): shared/ strictly, cli/, services/ and
scripts/ for what mypy checks by default and every function body. And each `# type: ignore` left
in the package says why, on its own line or the one before."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package belayer_rl
CHECKED = ("shared", "cli", "services", "scripts")


def test_the_package_type_checks(tmp_path: Path) -> None:
    # mypy finds `belayer_rl` as a folder of that name on its path: the repository, linked.
    (tmp_path / "belayer_rl").symlink_to(ROOT)
    packages = [arg for name in CHECKED for arg in ("-p", f"belayer_rl.{name}")]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *packages],
        cwd=tmp_path,
        env={"MYPYPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_type_ignore_says_why() -> None:
    silent = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if "# type: ignore" not in line:
                    continue
                after = re.search(r"# type: ignore(\[[^\]]*\])?(.*)", line)
                said = after is not None and after.group(2).strip().startswith("#")
                said_before = i > 0 and lines[i - 1].strip().startswith("#")
                if not (said or said_before):
                    silent.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert silent == [], "a type: ignore without its reason"
