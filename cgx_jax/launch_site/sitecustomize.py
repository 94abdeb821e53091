"""Lets a script that calls ``jax.distributed.initialize()`` with no arguments run unchanged
under ``python -m cgx_jax.launch``.

JAX reads the coordinator's address from ``JAX_COORDINATOR_ADDRESS``, but the process count
and id only from a cluster it detects (SLURM, Open MPI, Kubernetes, TPU: subclasses of
``jax._src.clusters.ClusterEnv``). The launcher puts this folder first on each rank's
``PYTHONPATH``, so Python runs this file at start-up (the technique tracing tools use to
instrument unmodified programs). It imports nothing heavy: it waits for JAX to import its
cluster module, then adds a cluster that reads the launcher's ``CGX_JAX_*`` variables and
puts it first, so it wins over a SLURM or MPI allocation the launcher itself runs in.
Importing jax here instead would read JAX's settings before the script sets them.

The ``sitecustomize`` this file shadows (Debian's, a virtual environment's) still runs: it is
found further along ``sys.path`` and executed last. Not for use outside the launcher: with
no ``CGX_JAX_PROCESS_ID`` in the environment it does nothing but run that one.
"""

import importlib.machinery
import importlib.util
import os
import sys

_CLUSTERS = "jax._src.clusters"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _add_launcher_cluster(clusters) -> None:
    class CgxJaxLaunch(clusters.ClusterEnv):
        """The processes of ``python -m cgx_jax.launch``."""
        name = "cgx_jax_launch"

        @classmethod
        def is_env_present(cls):
            return "CGX_JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(cls, *args, **kwargs):
            return os.environ["CGX_JAX_COORDINATOR"]

        @classmethod
        def get_process_count(cls):
            return int(os.environ["CGX_JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls):
            return int(os.environ["CGX_JAX_PROCESS_ID"])

        @classmethod
        def get_local_process_id(cls):
            return None  # every rank sees its own simulated CPU devices

    registered = getattr(clusters.ClusterEnv, "_cluster_types", None)
    if not isinstance(registered, list) or CgxJaxLaunch not in registered:
        # A JAX that registers clusters another way: say so, and let launch.initialize()
        # (which passes the process ids itself) be the way in.
        sys.stderr.write(
            "cgx_jax.launch: this jax registers its clusters differently, so a bare "
            "jax.distributed.initialize() cannot find the launcher's processes; call "
            "cgx_jax.launch.initialize() instead (tests/test_jax_internals.py)\n")
        return
    registered.insert(0, registered.pop(registered.index(CgxJaxLaunch)))


class _WhenJaxImportsClusters:
    """A one-shot import hook: runs ``_add_launcher_cluster`` right after ``jax._src.clusters``
    has been imported, whenever the script first imports jax."""

    def find_spec(self, name, path, target=None):
        if name != _CLUSTERS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _add_launcher_cluster(module)

        spec.loader.exec_module = exec_module
        return spec


def _run_shadowed_sitecustomize() -> None:
    path = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if "CGX_JAX_PROCESS_ID" in os.environ and _CLUSTERS not in sys.modules:
    sys.meta_path.insert(0, _WhenJaxImportsClusters())
_run_shadowed_sitecustomize()
