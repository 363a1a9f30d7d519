"""Every third-party module the installed packages import is a runtime dependency.

`bash scripts/install.sh` (the README's main-job command) installs no test extra, so a package
that the demo or a daemon imports but that only the test extra names fails there and nowhere else.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("api", "cli", "shared", "manager", "worker", "kernels", "frontend")
IMPORT_NAMES = {"pyzmq": "zmq", "pyyaml": "yaml"}  # distribution -> module where they differ


def runtime_modules() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    return {IMPORT_NAMES.get(n, n) for n in names}


def third_party_imports() -> dict[str, str]:
    found = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top != "kvpool" and top not in sys.stdlib_module_names:
                        found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_third_party_import_is_a_runtime_dependency() -> None:
    allowed = runtime_modules() | {"starlette"}  # starlette is what fastapi is built on
    missing = {m: where for m, where in third_party_imports().items() if m not in allowed}
    assert not missing, f"imported but not in [project] dependencies of pyproject.toml: {missing}"
