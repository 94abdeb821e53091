"""The JAX internals cgx_jax uses (cgx_jax/_src/collectives/jax_compat.py and the launcher's
start-up hook, cgx_jax/launch_site/sitecustomize.py), each checked to be where cgx looks for
it in the installed jax: an upgrade that moves one fails here, by name, instead of somewhere
deep in a multi-process run. And what cgx does when one is gone."""

import importlib

import jax
import pytest

from cgx_jax._src.collectives import jax_compat


def test_all_gather_invariant_is_where_cgx_looks():
    parallel = importlib.import_module("jax._src.lax.parallel")
    assert callable(getattr(parallel, "all_gather_invariant", None))
    assert jax_compat._jax_all_gather_invariant is parallel.all_gather_invariant


def test_the_distributed_client_is_where_cgx_looks():
    distributed = importlib.import_module("jax._src.distributed")
    assert hasattr(distributed.global_state, "client")
    assert jax_compat.distributed_client() is distributed.global_state.client


def test_cluster_registration_is_what_the_launcher_hook_extends():
    clusters = importlib.import_module("jax._src.clusters")
    assert isinstance(clusters.ClusterEnv._cluster_types, list)
    for method in ("is_env_present", "get_coordinator_address", "get_process_count",
                   "get_process_id", "get_local_process_id"):
        assert callable(getattr(clusters.ClusterEnv, method)), method


def test_the_ambient_mesh_is_where_cgx_looks(cpu_devices):
    mesh = jax.make_mesh((8,), ("data",), devices=cpu_devices[:8])
    assert jax_compat.ambient_mesh() is None
    with jax.sharding.set_mesh(mesh):
        assert jax_compat.ambient_mesh() == mesh  # outside jit
        seen = []
        jax.jit(lambda x: seen.append(jax_compat.ambient_mesh()) or x)(1.0)
        assert seen == [mesh]  # and inside, where jax.sharding.get_mesh refuses
    assert jax_compat.ambient_mesh() is None


def test_the_cuda_versions_module_is_where_cgx_looks():
    lib = importlib.import_module("jax._src.lib")
    assert hasattr(lib, "cuda_versions")  # None without the CUDA plugin
    version = jax_compat.jax_cuda_runtime_version()
    assert version is None or version >= 11000


def test_a_moved_distributed_client_is_a_clear_error(monkeypatch):
    distributed = importlib.import_module("jax._src.distributed")
    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(RuntimeError, match=r"jax._src.distributed.global_state.client, "
                                           rf"which jax {jax.__version__} does not have"):
        jax_compat.distributed_client()


def test_the_launcher_hook_says_so_when_clusters_register_another_way(capsys):
    import importlib.util
    import pathlib
    import types

    import cgx_jax

    path = pathlib.Path(cgx_jax.__file__).parent / "launch_site" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("cgx_launch_site", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # outside the launcher: installs nothing

    class ClusterEnv:  # a JAX whose clusters keep no _cluster_types list
        pass

    hook._add_launcher_cluster(types.SimpleNamespace(ClusterEnv=ClusterEnv))
    assert "call cgx_jax.launch.initialize() instead" in capsys.readouterr().err
    real = importlib.import_module("jax._src.clusters")
    before = list(real.ClusterEnv._cluster_types)
    try:  # the real one: the launcher's cluster goes first, nothing said
        hook._add_launcher_cluster(real)
        assert real.ClusterEnv._cluster_types[0].name == "cgx_jax_launch"
        assert capsys.readouterr().err == ""
    finally:
        real.ClusterEnv._cluster_types[:] = before
