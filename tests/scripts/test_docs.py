"""The docs stand alone and work from a fresh clone; the installer's order; bench_worker interleaves."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked(*suffixes: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split() if f.endswith(suffixes) and not f.startswith("tests/")]


def test_docs_and_code_do_not_point_at_issue_numbers():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in tracked(".md", ".py", ".sh")
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if re.search(r"\bissues? \d+", line, re.IGNORECASE)]
    assert hits == [], "project docs stand on their own"


def test_readme_commands_work_without_an_activated_environment_or_say_how():
    text = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text
    bare = [line for line in text.splitlines() if re.search(r"(?<![/\w])python3? scripts/", line)]
    assert bare == [], "write .venv/bin/python scripts/..."
    assert "seeded random weights" in text


def test_install_puts_numpy_in_before_torch_is_first_imported():
    lines = (ROOT / "scripts/install.sh").read_text().splitlines()
    torch_installs = [i for i, line in enumerate(lines) if '"$torch_req"' in line and "pip" in line]
    first_import = next(i for i, line in enumerate(lines) if "import torch" in line)
    assert torch_installs and all("numpy" in lines[i] for i in torch_installs)
    assert max(torch_installs) < first_import


def test_bench_worker_runs_its_modes_interleaved(monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    bench_worker = importlib.import_module("bench_worker")
    order: list[str] = []
    step = bench_worker.ModeRun.step

    def recording(self):
        order.append(self.mode)
        return step(self)

    monkeypatch.setattr(bench_worker.ModeRun, "step", recording)
    args = bench_worker.parser().parse_args(["--model", "tiny", "--requests", "2", "--min-output", "3",
                                             "--max-output", "3", "--max-model-len", "256", "--kv-blocks", "40",
                                             "--min-prompt", "8", "--max-prompt", "16"])
    res = bench_worker.measure(args, log=lambda *a: None)
    assert set(res["ratios"]) == {"static", "paged"} and res["modes"]["paged"]["tokens"] == 6
    assert order[:4] == ["static", "paged", "static", "paged"]
