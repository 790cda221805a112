"""Shared fixtures: one Ray instance per test session, tiny configs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests import shared_ray

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
# Tests name their own MLflow stores; a developer's MLFLOW_TRACKING_URI must not leak into them.
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Each xdist worker's own Rays (the multi-node cluster, the CLI's) keep their session files apart
# from the other worker's: Ray records "the current cluster" in its temp directory.  (The session
# Ray both workers share has a directory of its own: tests/shared_ray.py.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{os.environ['PYTEST_XDIST_WORKER']}")
    # One intra-op thread per worker (torch reads it when imported, after this): two workers with
    # torch's default of a thread per core would put four busy threads on a 2-core box.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch.compile in this process, not in a pool of compile workers it would start for each
    # process that compiles (their start-up cost more CPU than the few kernels the tests compile).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

_SHARED_RAY_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """In the xdist controller (or the one process of ``-n 0``): a directory for the session's
    shared Ray (``tests/shared_ray.py``), started by the first test that needs Ray."""
    if hasattr(config, "workerinput"):
        return  # a worker: it has the controller's directory in its environment
    directory = tempfile.mkdtemp(prefix="grs")  # short: Ray's socket paths live under it
    os.environ[shared_ray.DIRECTORY_ENV] = directory
    os.environ[shared_ray.CONTROLLER_ENV] = str(os.getpid())
    # Tests connect to the shared Ray by its address, and Ray turns token auth on by itself only
    # for a cluster it starts or finds on its own (ray.init() sets this in a process that starts
    # Ray). The token is ~/.ray's, as the helper's. The workers inherit all three.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    config.stash[_SHARED_RAY_DIR] = directory


def pytest_unconfigure(config):
    directory = config.stash.get(_SHARED_RAY_DIR, None)
    if directory is not None:
        shared_ray.stop(directory)
        shutil.rmtree(directory, ignore_errors=True)


def _init_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=shared_ray.address(os.environ[shared_ray.DIRECTORY_ENV]), log_to_driver=False)


@pytest.fixture(autouse=True, scope="session")
def _connector_frames_only() -> Iterator[None]:
    """RLlib's connector pieces find their constructor arguments without reading source files
    (``tests/connector_frames.py``: half the CPU of an in-process learner build or EnvRunner).
    Imported here, not at the top: Ray reads ``RAY_AUTH_MODE`` (set above) when first imported."""
    from tests.connector_frames import connector_frames_only

    with connector_frames_only():
        yield


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every integration test (starting Ray costs ~5 s): one
    instance for both xdist workers (``tests/shared_ray.py``), each worker its own Ray job."""
    import ray

    _init_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def lasting_ray_address() -> str:
    """The session's shared Ray, for a test that disconnects and connects again as a new Ray job
    (it outlives this process's connections to it: ``tests/shared_ray.py``)."""
    return shared_ray.address(os.environ[shared_ray.DIRECTORY_ENV])


@pytest.fixture(scope="module")
def without_shared_ray():
    """For a test module that connects to Ray of its own (a multi-node ``ray.cluster_utils.Cluster``):
    the shared local instance, if running, is shut down for the module and started again after it."""
    import ray

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if was_running:
        _init_local_ray()


# --- lanes -------------------------------------------------------------------------------------
# The fast lane (``-m "not e2e and not gpu"``) starts neither Ray nor a subprocess.  A test that
# does carries ``@pytest.mark.e2e`` (tests/README.md): a test using a Ray fixture gets it here,
# and any other test that starts a process without it fails with what to do.
#
# Processes that are not "a subprocess the test starts": torch's compile workers and the
# tool look-ups some libraries run when they are imported (ctypes' find_library).
_TOOLS = {
    "ldconfig",
    "gcc",
    "g++",
    "cc",
    "c++",
    "clang",
    "clang++",
    "ld",
    "objdump",
    "uname",
    "nvcc",
    "which",
    "openssl",
}
_TORCH_WORKERS = tuple(  # its workers, and its .so load check, which names a file under its cache dir
    filter(None, ("torch._inductor", "torch/_inductor", "torchinductor", os.environ.get("TORCHINDUCTOR_CACHE_DIR")))
)
_RAY_FIXTURES = ("ray_session", "without_shared_ray", "lasting_ray_address")
_RUN_FIRST = "tests/e2e/test_multinode_fault_e2e.py"


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config, items):
    """A test that uses a Ray fixture starts Ray: it is an ``e2e`` test wherever it lives."""
    for item in items:
        if set(getattr(item, "fixturenames", ())) & set(_RAY_FIXTURES) and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
    # The multi-node test connects this process to a cluster of its own after the shared local Ray
    # is shut down.  Run after an algorithm was built and stopped on the shared Ray in this process,
    # its Tune trial actors were cancelled before they started (seen 3 times, 2026-11-26).  A cause
    # found since: Ray Tune's registry kept the process's first job id across ray.shutdown()
    # (gradmon_ray.envs.tune_registry.tune_registry_follows_this_job, now called wherever Ray starts); not
    # re-tried in that order, so the module still runs first, before anything else has used Ray in
    # this process (under xdist's ``--dist loadfile`` the first module collected is the first one a
    # worker takes).  It is also the longest.
    # Then every other integration module, then the fast ones: the two xdist workers take modules in
    # this order (--no-loadscope-reorder), so the long ones start early and the short ones fill in.
    # A module ranks by its first integration test, so that its tests stay together.
    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        rank = 0 if module == _RUN_FIRST else 1 if item.get_closest_marker("e2e") else 2
        module_rank[module] = min(rank, module_rank.get(module, 2))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::", 1)[0]])  # stable: order kept within a rank


def _implicit(args) -> bool:
    """A C/C++ tool (torch.compile builds its kernels with one) or one of torch's compile workers."""
    words = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    line = " ".join(words)
    first = os.path.basename(line.split()[0]) if line.split() else ""
    return first in _TOOLS or any(worker in line for worker in _TORCH_WORKERS)


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_process(request, monkeypatch):
    """In a test without the ``e2e``/``gpu`` mark, starting a process (Ray starts its own with
    ``subprocess.Popen``, ``ray.init`` included) fails the test with what to do."""
    if request.node.get_closest_marker("e2e") or request.node.get_closest_marker("gpu"):
        yield
        return
    import subprocess

    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        if not _implicit(args):
            raise AssertionError(
                f"{request.node.nodeid} starts a process ({args!r}): mark the test @pytest.mark.e2e "
                "(the fast lane starts no Ray and no subprocess)"
            )
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield


# --- MLflow sqlite stores --------------------------------------------------------------------
# A new sqlite store runs all of MLflow's schema migrations (~0.9 s here, and many tests make
# their own store).  In this process a new store's schema is copied instead from one store the
# session migrated for real (sqlite's backup API: the same tables, indexes and alembic version,
# byte for byte); MLflow's own start-up checks then run on it as usual.  Subprocesses and Ray
# workers are untouched and migrate for real.
@pytest.fixture(scope="session", autouse=True)
def _mlflow_sqlite_schema_from_a_template(tmp_path_factory):
    import sqlite3

    import mlflow.store.db.utils as db_utils

    migrate = db_utils._initialize_tables
    template = tmp_path_factory.mktemp("mlflow-template") / "schema.db"

    def initialize_tables(engine):
        if engine.url.get_backend_name() != "sqlite" or not engine.url.database:
            return migrate(engine)
        if not template.exists():
            migrate(engine)
            with sqlite3.connect(engine.url.database) as migrated, sqlite3.connect(template) as copy:
                migrated.backup(copy)
            return None
        raw = engine.raw_connection()
        try:
            with sqlite3.connect(template) as schema:
                schema.backup(raw.driver_connection)
        finally:
            raw.close()
        return None

    db_utils._initialize_tables = initialize_tables
    yield
    db_utils._initialize_tables = migrate


# --- the CLI in-process --------------------------------------------------------------------------
# ``gradmon-ray``'s ``main`` sets process-wide state meant for a process that exits afterwards:
# environment variables (MLflow's HTTP retries, URL printing) and Ray's noise filter around the
# algorithm's build.  A test that calls ``main`` in this process gets both put back after it, so no
# later test runs under a previous test's CLI settings.
@pytest.fixture(autouse=True)
def _cli_process_state_is_put_back():
    from gradmon_ray.app import ray_noise

    environ, quiet = dict(os.environ), ray_noise.quiet_wanted()
    yield
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)
    if not quiet:
        ray_noise.reset_quiet()


@pytest.fixture
def world(tmp_path) -> Iterator[None]:
    """A real one-process gloo ``torch.distributed`` world (rank 0 of 1) for the test, destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a torch.distributed world is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- CPU seconds per test module (opt-in) ---------------------------------------------------------
# The suite is CPU-bound on the 2-core box, and wall time there depends on whatever else runs: the
# cost of a module is its CPU seconds.  With GRADMON_TEST_CPU_LOG=<file> each module's CPU seconds and
# wall seconds are appended to <file> as a JSON line, read from the cpuacct cgroup this process runs
# in when it has one of its own (every descendant counted: the shared Ray, its actors, servers,
# subprocesses, orphans; tests/README.md "Time" says how), else from this process and its waited-for
# children only (RUSAGE_SELF + RUSAGE_CHILDREN: no Ray worker is one of those).  Per module with
# ``-n 0``: two xdist workers in one cgroup count each other's modules.
_CPU_LOG = os.environ.get("GRADMON_TEST_CPU_LOG")
_MODULE_START = pytest.StashKey[dict]()


def _cpu_seconds() -> tuple[float, str]:
    """CPU seconds so far, and where they were read ("cgroup" or "rusage")."""
    import resource

    with contextlib.suppress(OSError, ValueError):
        for line in open("/proc/self/cgroup"):  # noqa: SIM115 - a few lines, read once
            _, controllers, path = line.strip().split(":", 2)
            if "cpuacct" in controllers.split(",") and path != "/":  # the root one is the whole machine's
                with open(f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage") as usage:
                    return int(usage.read()) / 1e9, "cgroup"
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, "rusage"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import json
    import time

    module = item.nodeid.split("::", 1)[0]
    started = item.config.stash.setdefault(_MODULE_START, {})
    if module not in started:
        started[module] = (_cpu_seconds()[0], time.monotonic())
    yield
    if nextitem is None or nextitem.nodeid.split("::", 1)[0] != module:
        cpu, wall = started.pop(module)
        now, source = _cpu_seconds()
        record = {"module": module, "cpu_s": round(now - cpu, 1), "wall_s": round(time.monotonic() - wall, 1)}
        record.update(source=source, worker=os.environ.get("PYTEST_XDIST_WORKER", "-"))
        with open(_CPU_LOG, "a") as log:
            log.write(json.dumps(record) + "\n")
