"""docs/architecture.md's layer drawing is the import contract: it equals the ``layers`` contract of
``[tool.importlinter]`` in pyproject.toml, layer for layer; and no module of fedge imports a circle, not
even through imports made only for type checking (which the contract does not count)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent

Layer = tuple[str, frozenset[str]]
"""(separator, modules): ``|`` independent, ``:`` may import each other, ``""`` one module; an optional
module keeps its parentheses, as import-linter writes it."""


def _layer(expression: str, where: str) -> Layer:
    """One layer from ``a | b``, ``a : b`` or ``a``, with ``pkg.{x, y}`` expanded in the layer's own kind."""
    seps = set(re.findall(r"\s([|:])\s", expression))
    assert len(seps) <= 1, f"{where}: a layer mixes '|' and ':': {expression}"
    sep = seps.pop() if seps else ""
    modules: set[str] = set()
    for token in re.split(r"\s[|:]\s", expression):
        token = token.strip()
        group = re.fullmatch(r"(\(?)([\w.]+)\.\{([\w\s,]+)\}(\)?)", token)
        if group:
            left, prefix, names, right = group.groups()
            assert sep or "," not in names, f"{where}: say how {token} relate, with '|' or ':'"
            modules |= {f"{left}{prefix}.{n.strip()}{right}" for n in names.split(",")}
        else:
            assert re.fullmatch(r"\(?[\w.]+\)?", token), f"{where}: not a module: {token!r} in {expression!r}"
            modules.add(token)
    return (sep if len(modules) > 1 else ""), frozenset(modules)


def contract_layers() -> list[Layer]:
    """The ``layers`` contract of pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    return [_layer(" ".join(layer.split()), "pyproject.toml") for layer in contract["layers"]]


def drawn_layers(text: str) -> list[Layer]:
    """The layers of the first drawing (fenced block) of docs/architecture.md.

    A line indented less than the comment column that starts with a module (or ``(`` and a module) starts
    a layer, one that starts with ``:`` or ``|`` continues it; what follows two spaces is a comment, and
    any other line (a comment on its own, the rule ``───``) is not part of the contract.
    """
    block = text.split("```\n", 2)[1]
    expressions: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        body = re.split(r"\s{2,}", line.strip())[0]
        if indent >= 10 or not body:
            continue
        if re.match(r"\(?fedge\b", body):
            expressions.append(body)
        elif re.match(r"[|:]\s", body):
            assert expressions, f"docs/architecture.md: {line!r} continues no layer"
            expressions[-1] += " " + body
    return [_layer(e, "docs/architecture.md") for e in expressions]


def _render(layers: list[Layer]) -> str:
    return "\n".join(f" {sep or ' '} ".join(sorted(mods)) for sep, mods in layers)


def test_the_drawing_is_the_contract() -> None:
    drawn = drawn_layers((ROOT / "docs" / "architecture.md").read_text())
    contract = contract_layers()
    assert len(contract) > 10 and any(sep == ":" for sep, _ in contract)  # the parsers found the real thing
    first = next((i for i, (a, b) in enumerate(zip(drawn, contract, strict=False)) if a != b),
                 min(len(drawn), len(contract)))
    assert drawn == contract, (
        "docs/architecture.md draws other layers than [tool.importlinter]'s `layers` contract in pyproject.toml "
        f"(from layer {first + 1} on, counting from the top); make them equal.\n"
        f"-- drawn:\n{_render(drawn)}\n-- contract:\n{_render(contract)}")


def test_the_parser_reads_the_notation() -> None:
    text = ("intro\n```\n fedge.a                  comment\n ───\n fedge.b.{x, y}\n   | fedge.c\n"
            "                          a comment line: fedge.z | fedge.w\n fedge.d : (fedge.e)\n fedge.f.{g}\n```\n"
            "```\n fedge.other_block\n```\n")
    assert drawn_layers(text) == [("", frozenset({"fedge.a"})),
                                  ("|", frozenset({"fedge.b.x", "fedge.b.y", "fedge.c"})),
                                  (":", frozenset({"fedge.d", "(fedge.e)"})),
                                  ("", frozenset({"fedge.f.g"}))]


def test_no_module_imports_a_circle() -> None:
    """Layers allow siblings to import each other; fedge's modules still form a DAG, type-checking imports
    included (import-linter skips those, which is how privacy ↔ report in fedge.audit went unseen)."""
    graph = grimp.build_graph("fedge", exclude_type_checking_imports=False)
    imports = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in graph.modules)
               for m in sorted(graph.modules)}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in imports[module]:
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in imports:
        if module not in state:
            visit(module, [module])
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# -- the package table names every module -----------------------------------------------------------------------

def table_rows(text: str) -> dict[str, set[str]]:
    """docs/architecture.md's package table: package (``fedge.x``, or a sub-package ``fedge.x.y``) -> every name
    its row writes in backticks (``models``, ``strategies/`` and ``fedge.x.y``'s last part too)."""
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\| `(fedge(?:\.\w+)+)` \| (.*) \|$", line)
        if m:
            names = set(re.findall(r"`([\w./]+)`", m.group(2)))
            rows[m.group(1)] = names | {n.rstrip("/").rsplit(".", 1)[-1] for n in names}
    return rows


def package_modules(root: Path) -> dict[str, set[str]]:
    """Every package under ``root`` (fedge/), sub-packages at any depth included: its modules and sub-packages,
    by name."""
    packages = sorted(init.parent for init in root.rglob("__init__.py") if init.parent != root)
    return {".".join(("fedge", *pkg.relative_to(root).parts)):
            {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
            for pkg in packages}


def unnamed(rows: dict[str, set[str]], packages: dict[str, set[str]]) -> list[str]:
    """The packages without a row, and the modules their row does not name."""
    out = [f"{pkg} (no row)" for pkg in packages if pkg not in rows]
    out += [f"{pkg}.{m}" for pkg, mods in packages.items() if pkg in rows for m in sorted(mods - rows[pkg])]
    return out


def test_the_package_table_names_every_module() -> None:
    rows = table_rows((ROOT / "docs" / "architecture.md").read_text())
    packages = package_modules(ROOT / "fedge")
    assert len(packages) > 10 and len(rows) > 10  # the parsers found the real thing
    missing = unnamed(rows, packages)
    assert missing == [], ("docs/architecture.md's package table does not name " + ", ".join(missing)
                           + ": add each to its package's row, with what it holds")


def test_the_table_check_fails_for_a_missing_module(tmp_path: Path) -> None:
    for name in ("alpha.py", "beta.py", "__init__.py", "sub/__init__.py", "sub/gamma.py", "sub/deep/__init__.py",
                 "sub/deep/delta.py"):
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "__init__.py").write_text("")
    packages = package_modules(tmp_path)
    assert packages == {"fedge.other": set(), "fedge.pkg": {"alpha", "beta", "sub"}, "fedge.pkg.sub": {"gamma", "deep"},
                        "fedge.pkg.sub.deep": {"delta"}}
    rows = table_rows("| package | holds |\n|---|---|\n| `fedge.pkg` | `alpha` (a), `fedge.pkg.sub` (s) |\n"
                      "| `fedge.pkg.sub` | `deep/` (d) |\n")
    assert unnamed(rows, packages) == ["fedge.other (no row)", "fedge.pkg.sub.deep (no row)", "fedge.pkg.beta",
                                       "fedge.pkg.sub.gamma"]


def test_the_real_table_fails_without_one_of_its_modules() -> None:
    """Take one module's name out of the real table (observe's ``monitor``, a sub-package's ``running``): the
    check names exactly it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = package_modules(ROOT / "fedge")
    assert {"fedge.observe", "fedge.coordinator.strategies", "fedge.edge.models.families"} <= set(packages)
    for package, module in (("fedge.observe", "monitor"), ("fedge.coordinator.strategies", "running")):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{package}` |")]
        cut = row.replace(f"`{module}`", module)
        assert unnamed(table_rows(text.replace(row, cut)), packages) == [f"{package}.{module}"]


def test_the_readme_layout_names_every_package() -> None:
    """README's layout lists every package (``fedge/x/``) and names each sub-package (``y/``) in its package's
    lines; the modules are docs/architecture.md's table's to name."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"fedge/(\w+)/", layout))
    packages = package_modules(ROOT / "fedge")
    top = {p.removeprefix("fedge.") for p in packages if p.count(".") == 1}
    missing = sorted(top - listed)
    assert missing == [], f"README's layout does not list fedge/{{{', '.join(missing)}}}/"
    subs = sorted(p for p in packages if p.count(".") > 1 and not re.search(rf"\b{p.rsplit('.', 1)[1]}/", layout))
    assert subs == [], f"README's layout does not name the sub-packages {', '.join(subs)} (as name/)"
