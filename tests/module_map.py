"""The module map of docs/architecture.md, generated from the code: every package and subpackage with the
first paragraph of its docstring, every module with that of its own.

`python tests/module_map.py` prints it; `--write` puts it between the markers in docs/architecture.md, and
tests/test_architecture.py fails when the committed map differs from the code.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- module map: begin (tests/module_map.py --write) -->", "<!-- module map: end -->"
PACKAGES = (
    ROOT / "meshjob",
    ROOT / "operator" / "meshjob_operator",
    ROOT / "trainer" / "meshjob_trainer",
    ROOT / "cluster" / "meshjob_cluster",
    ROOT / "bench" / "meshjob_bench",
)


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line (empty where it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""


def package_lines(package: Path, depth: int = 0) -> list[str]:
    name = "/".join(package.relative_to(package.parents[depth]).parts)
    lines = [f"{'  ' * depth}- **`{name}/`**: {summary(package / '__init__.py')}"]
    for module in sorted(package.glob("*.py")):
        if module.name != "__init__.py":
            lines.append(f"{'  ' * (depth + 1)}- `{module.name}`: {summary(module)}")
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        lines += package_lines(sub, depth + 1)
    return lines


def module_map() -> str:
    return "\n".join(line for package in PACKAGES for line in package_lines(package)) + "\n"


def with_map(text: str) -> str:
    """`text` (docs/architecture.md) with the map between its markers replaced by the generated one."""
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{module_map()}{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(with_map(DOC.read_text()))
    else:
        sys.stdout.write(module_map())
