"""The public API is one list, ``cgx_jax.__all__`` (docs/design.md section 6): what ``import
cgx_jax`` exposes, each name documented with an example (each function with its
arguments and result), implemented under ``cgx_jax._src``
(which is not API), and the internals not importable under their old public paths."""

import dataclasses
import inspect
import pathlib
import subprocess
import sys

import pytest

import cgx_jax as cgx

# The API. A change here is a change users see: the CHANGELOG says it.
PUBLIC = [
    "AdaptiveConfig", "Codec", "CompressedAllReduceState", "ErrorTable", "LayerPolicy",
    "LinkProfile", "LinkWatch", "ProcessesDisagreeError", "compressed_all_gather",
    "compressed_allreduce", "compressed_pmean", "compressed_psum", "compressed_psum_scatter",
    "dequantize", "estimate", "fit_policy", "has_cuda_support", "init_residual",
    "keep_freed_memory", "layer_errors", "leaf_paths", "local_value_and_grad", "packet_bytes",
    "quantize", "refit_policy", "shard_state", "state_specs", "summary", "tree_wire_bytes",
    "value_and_grad", "wire_bytes",
]
# Run as programs, not imported by `import cgx_jax`: python -m cgx_jax.launch / .bench.
PUBLIC_MODULES = {"cgx_jax.launch", "cgx_jax.bench"}
PACKAGE = pathlib.Path(cgx.__file__).parent


def test_the_api_is_one_list():
    assert sorted(cgx.__all__) == sorted(PUBLIC)
    assert len(set(cgx.__all__)) == len(cgx.__all__)


def test_import_cgx_jax_exposes_the_api_and_nothing_else():
    # dir() before any name is used, vars() once one is (the API is imported at first use).
    script = ("import cgx_jax\n"
              "public = lambda names: ' '.join(sorted(n for n in names if n[0] != '_'))\n"
              "print(public(dir(cgx_jax)))\n"
              "cgx_jax.Codec\n"
              "print(public(vars(cgx_jax)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    before, after = done.stdout.splitlines()
    assert before.split() == after.split() == sorted(PUBLIC)
    with pytest.raises(AttributeError, match="module 'cgx_jax' has no attribute 'Codecs'"):
        cgx.Codecs  # noqa: B018


def test_the_launcher_starts_without_jax():
    """``import cgx_jax`` imports the API at its first use, so ``python -m cgx_jax.launch``
    (which uses none of it) starts in a fraction of a second, without jax's memory."""
    script = "import sys, cgx_jax.launch; print(sorted({'jax', 'jaxlib'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_documented_with_an_example(name):
    doc = inspect.getdoc(getattr(cgx, name)) or ""
    assert "Example" in doc and ">>>" in doc, f"cgx_jax.{name} has no example in its docstring"


FUNCTIONS = [name for name in PUBLIC if inspect.isfunction(getattr(cgx, name))]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_public_function_documents_its_arguments_and_result(name):
    """Google style, as optax and Flax write it: an ``Args:`` section naming every
    parameter (several may share a line), then ``Returns:``, before the example."""
    function = getattr(cgx, name)
    doc = inspect.getdoc(function)
    parameters = list(inspect.signature(function).parameters)
    assert "Returns:" in doc, f"cgx_jax.{name}: no Returns: section"
    assert doc.index("Returns:") < doc.index("Example"), name
    if parameters:
        args = doc[doc.index("Args:"):doc.index("Returns:")] if "Args:" in doc else ""
        named = {word for line in args.splitlines()[1:] if ":" in line
                 for word in line.split(":")[0].replace(",", " ").split()}
        assert set(parameters) <= named, (
            f"cgx_jax.{name}: Args: does not name {sorted(set(parameters) - named)}")


def _fields(cls) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    return list(getattr(cls, "_fields", ()))  # a NamedTuple's


CLASSES = [name for name in PUBLIC if inspect.isclass(getattr(cgx, name))
           and _fields(getattr(cgx, name))]


@pytest.mark.parametrize("name", CLASSES)
def test_every_public_class_documents_its_fields(name):
    """An ``Attributes:`` section naming every field, before the example."""
    doc = inspect.getdoc(getattr(cgx, name))
    assert "Attributes:" in doc, f"cgx_jax.{name}: no Attributes: section"
    assert doc.index("Attributes:") < doc.index("Example"), name
    section = doc[doc.index("Attributes:"):doc.index("Example")]
    named = {line.split(":")[0].strip() for line in section.splitlines()[1:]
             if line.startswith("  ") and not line.startswith("    ") and ":" in line}
    missing = set(_fields(getattr(cgx, name))) - named
    assert not missing, f"cgx_jax.{name}: Attributes: does not name {sorted(missing)}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_implemented_under_src(name):
    assert getattr(cgx, name).__module__.startswith("cgx_jax._src."), name


def test_the_internals_are_not_importable_under_public_paths():
    public_files = {path.relative_to(PACKAGE).parts[0] for path in PACKAGE.glob("*")
                    if path.name != "__pycache__" and not path.name.startswith(".")}
    allowed = {"__init__.py", "_src", "launch.py", "launch_child.py", "launch_site", "bench"}
    assert public_files - {p for p in public_files if p.endswith(".so")} <= allowed
    for old in ("cgx_jax.reduction", "cgx_jax.sharded", "cgx_jax.collectives"):
        with pytest.raises(ModuleNotFoundError):
            __import__(old)
