"""The package's shape (docs/design.md section 1): no import cycle, every module importing
only modules of its layer or below (``LAYERS``), no module reaching into another
module's ``_private`` names, ``jax._src`` and Flax each in one module only, and every design
reference pointing at the document inside the repository."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cgx_jax"
# These read the source tree; against an installed wheel (tools/wheel_check.sh) it is absent.
pytestmark = pytest.mark.skipif(not PACKAGE.is_dir(), reason="needs the source tree")
# The compiled nanobind modules are named like private modules but are the package's own.
EXTENSION_MODULES = {"_cgx_cpu", "_cgx_cuda"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def top_level_imports(path: pathlib.Path):
    """(module, imported names) of the imports run when the module is imported (not those
    inside functions)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [alias.name for alias in node.names]


def package_dependencies(name: str) -> set[str]:
    deps = set()
    for module, names in top_level_imports(MODULES[name]):
        submodules = {f"{module}.{n}" for n in names} & MODULES.keys()
        deps |= submodules  # from cgx_jax._src import fusion: the module cgx_jax._src.fusion
        if module in MODULES and (not names or len(submodules) < len(names)):
            deps.add(module)
    return deps - {name}


def test_there_is_no_import_cycle():
    graph = {name: package_dependencies(name) for name in MODULES}
    state = {}

    def visit(name, stack):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack + [name, dep]))
            if dep not in state:
                visit(dep, stack + [name])
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [])


# The layering, bottom first (docs/design.md's package map describes each): a module imports
# only modules of its own row or of rows above it. A new module gets its row here.
LAYERS = [
    ["codec"], ["axes"], ["validation"], ["flax_compat"], ["trees"], ["seeds"], ["memory"],
    ["backends"], ["collectives"], ["layouts"], ["vma"], ["fusion"], ["policy"], ["link_model"],
    ["consistency"], ["reduction"], ["api"], ["sharded"], ["fsdp"], ["data_parallel"],
    ["adaptive"], ["optax_transform"], ["public"],
    ["launch", "launch_child", "launch_site", "netem", "ranks", "worker", "supervisor"],
    ["bench"],
]


def layer(name: str) -> int | None:
    """The row of module ``name`` in ``LAYERS`` (``None`` for the package and ``_src``)."""
    parts = [p for p in name.split(".")[1:] if p != "_src"]
    if not parts:
        return None
    found = [i for i, row in enumerate(LAYERS) if parts[0] in row]
    assert found, f"{name} has no row in LAYERS (tests/test_package_layout.py)"
    return found[0]


def test_modules_import_only_what_the_layers_list_above_them():
    for name in MODULES:
        row = layer(name)
        for dep in package_dependencies(name):
            dep_row = layer(dep)
            assert row is None or dep_row is None or dep_row <= row, (
                f"{name} imports {dep}, listed below it in LAYERS")


def test_the_layer_check_finds_an_upward_import(monkeypatch):
    real = package_dependencies
    monkeypatch.setitem(globals(), "package_dependencies",
                        lambda name: real(name) | ({"cgx_jax._src.api"}
                                                   if name == "cgx_jax._src.codec" else set()))
    with pytest.raises(AssertionError, match="cgx_jax._src.codec imports cgx_jax._src.api"):
        test_modules_import_only_what_the_layers_list_above_them()


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    # The check above must be able to fail: a fake edge codec -> api closes a cycle.
    real = package_dependencies
    monkeypatch.setitem(globals(), "package_dependencies",
                        lambda name: real(name) | ({"cgx_jax._src.api"}
                                                   if name == "cgx_jax._src.codec" else set()))
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_there_is_no_import_cycle()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_private_names_of_another(name):
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    imported_modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cgx_jax"):
            for alias in node.names:
                assert not (alias.name.startswith("_") and alias.name not in EXTENSION_MODULES), (
                    f"{path.relative_to(ROOT)} imports {alias.name} from {node.module}")
                if f"{node.module}.{alias.name}" in MODULES:
                    imported_modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cgx_jax"):
                    imported_modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules and node.attr.startswith("_")
                and node.attr not in EXTENSION_MODULES):
            pytest.fail(f"{path.relative_to(ROOT)} uses {node.value.id}.{node.attr}")


def test_jax_internals_are_confined_to_jax_compat():
    users = sorted(str(p.relative_to(ROOT)) for p in MODULES.values()
                   if re.search(r"(?<![\w.])jax\._src", p.read_text()))
    # The launcher's start-up hook names JAX's cluster module too: it runs before the script
    # and may import neither cgx_jax nor jax (cgx_jax/launch_site/sitecustomize.py).
    assert users == ["cgx_jax/_src/collectives/jax_compat.py",
                     "cgx_jax/launch_site/sitecustomize.py"]


def test_flax_is_known_in_one_module():
    """Flax is optional: one module finds out whether the program uses it (flax_compat.py)."""
    users = sorted(str(p.relative_to(ROOT)) for p in MODULES.values()
                   if re.search(r"from flax\b|import flax\b|[\"']flax[\"']", p.read_text()))
    assert users == ["cgx_jax/_src/flax_compat.py"]


def test_design_references_point_inside_the_repository():
    assert (ROOT / "docs" / "design.md").is_file()
    sources = [p for folder in ("cgx_jax", "tests", "examples", "xla_ffi")
               for p in (ROOT / folder).rglob("*")
               if p.suffix in (".py", ".h", ".cc", ".cu", ".sh")]
    stale = [str(p.relative_to(ROOT)) for p in sources + [ROOT / "README.md"]
             if p != pathlib.Path(__file__).resolve()
             and "DESIGN.md" in p.read_text().replace("docs/design.md", "")]
    assert stale == []
