"""Data parallelism: one mesh over every device of every process, one code path for all.

The global batch is split over the mesh's "data" axis; parameters, BatchNorm
statistics and optimiser state are replicated. Nothing else changes: the train
step is the single-device function, jitted with these shardings, and XLA's SPMD
partitioner inserts the collectives (an all-reduce of the gradients, and of the
BatchNorm batch moments, which are therefore taken over the global batch).

The device-resident training set is replicated, not sharded: every device holds
all of it (150 MB for CIFAR-10, against 141 GB on an H200), so each step's
batch is a local gather of that device's slice of the global permutation, with
no cross-device traffic for data, and the example order is exactly the
single-device order for any device count.

With parallel.fsdp=N the mesh is 2-D, data x fsdp (data = devices / N), and
parameters, optimiser state and EMA weights are split over the "fsdp" axis
(FSDP / ZeRO-3 style): each tensor along one dimension that N divides, tensors
under FSDP_MIN_ELEMENTS elements replicated (fsdp_spec). The batch is split over
both axes, so every device still takes batch / devices images. XLA's SPMD
partitioner then gathers each layer's weights where the step needs them and
reduce-scatters the gradients: no collective is written here either.

Multi-process runs (several machines, or several processes on one) call
`initialize` first; every process then loads the same files, builds the same
global mesh and feeds its own devices."""
import atexit
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.runtime import supervise


class DistributedError(RuntimeError):
    """The multi-process settings are incomplete or contradictory; the message names them."""


def is_main_process() -> bool:
    """Process 0 writes the logs, metrics and summary; checkpoints are written by all."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (e.g. one got SIGTERM), so all
    processes stop at the same step. A no-op with one process."""
    if jax.process_count() == 1:
        return bool(flag)
    flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
    return bool(np.any(flags))


def first_process(flag: bool) -> int | None:
    """The index of the first process whose `flag` is true (None: none's), the same on
    every process: a callback's stop on one process stops them all at one step."""
    if jax.process_count() == 1:
        return 0 if flag else None
    flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
    found = np.flatnonzero(np.asarray(flags))
    return int(found[0]) if found.size else None


# Environments where a scheduler starts one process per task and JAX's cluster
# auto-detection fills in the coordinator, process count and process id.
CLUSTER_SIZE_VARIABLES = supervise.CLUSTER_SIZE_VARIABLES


def distributed_settings(coordinator_address=None, num_processes=None, process_id=None,
                         environ=None):
    """The jax.distributed.initialize arguments for this process, or None for a
    single-process run.

    Flags win over the environment: JAX_COORDINATOR_ADDRESS (read by JAX itself),
    JAX_NUM_PROCESSES and JAX_PROCESS_ID. Values still unset are left to JAX's
    auto-detection under SLURM or Open MPI when those report more than one task.
    """
    environ = os.environ if environ is None else environ

    def from_env(value, name, kind):
        if value is not None or name not in environ:
            return value
        try:
            return kind(environ[name])
        except ValueError:
            raise DistributedError(f"${name}={environ[name]!r} is not a valid "
                                   f"{kind.__name__}") from None

    coordinator_address = from_env(coordinator_address, "JAX_COORDINATOR_ADDRESS", str)
    num_processes = from_env(num_processes, "JAX_NUM_PROCESSES", int)
    process_id = from_env(process_id, "JAX_PROCESS_ID", int)
    cluster = any(int(environ.get(name, "1") or 1) > 1 for name in CLUSTER_SIZE_VARIABLES)
    explicit = (coordinator_address, num_processes, process_id)
    if all(value is None for value in explicit):
        return {} if cluster else None
    if num_processes == 1:
        return None
    if not cluster and None in explicit:
        missing = [name for name, value in zip(
            ("--coordinator_address", "--num_processes", "--process_id"), explicit)
            if value is None]
        raise DistributedError(
            "a multi-process run outside SLURM/Open MPI needs all of --coordinator_address, "
            f"--num_processes and --process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
            f"JAX_PROCESS_ID); missing: {', '.join(missing)}")
    if num_processes is not None and num_processes < 1:
        raise DistributedError(f"--num_processes={num_processes}: must be >= 1")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise DistributedError(f"--process_id={process_id}: must be in [0, {num_processes})")
    return {"coordinator_address": coordinator_address, "num_processes": num_processes,
            "process_id": process_id}


@dataclasses.dataclass
class PeerWatch:
    """This process's place in a multi-process run, and the watch over its peers: what the
    line it ends with names. The run tells it where its checkpoints go (start.start)."""
    timeout: float | None  # seconds a silent peer may take (None: no watch runs)
    checkpoints: str | None = None  # the run's checkpoint directory, once it is known


def initialize(coordinator_address=None, num_processes=None, process_id=None,
               peer_timeout: float | None = None) -> PeerWatch | None:
    """Joins the multi-process run the flags/environment describe; None for a single process.

    Must run before anything else touches JAX's devices. peer_timeout: seconds after
    which a silent process counts as lost (watch_peers); JAX's own heartbeat limit,
    which aborts the process natively, is set well beyond it. Returns the PeerWatch to
    pass to train_and_evaluate (peers=), so that a lost peer's line names the newest
    checkpoint.
    """
    settings = distributed_settings(coordinator_address, num_processes, process_id)
    if settings is None:
        return None
    if peer_timeout:
        settings["heartbeat_timeout_seconds"] = int(max(100, 3 * peer_timeout))
    try:
        if peer_timeout and settings.get("process_id") == 0 and settings.get("num_processes"):
            with coordination_service_apart(settings, peer_timeout):
                jax.distributed.initialize(**settings)
        else:
            jax.distributed.initialize(**settings)
    except (RuntimeError, ValueError) as error:
        raise DistributedError(f"jax.distributed.initialize({settings}) failed: {error}") from error
    peers = PeerWatch(peer_timeout or None)
    if peer_timeout:
        watch_peers(peers)
    return peers


# The coordination service, in a process of its own (see coordination_service_apart).
SERVICE_PROCESS = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the trainers
address, count, heartbeat, parent, grace = sys.argv[1:]
grace = [float(grace)]  # process 0 lost: the others notice it is gone, say so and stop
def finished(*_):  # process 0 ends normally: the others are leaving JAX's shutdown barrier
    grace[0] = 5.0  # too, and a service gone before they have is a native abort there
signal.signal(signal.SIGTERM, finished)
from jax._src.lib import _jax
service = _jax.get_distributed_runtime_service(address, int(count),
                                               heartbeat_timeout=int(heartbeat))
while os.getppid() == int(parent):
    time.sleep(0.5)
time.sleep(grace[0])
service.shutdown()
"""


class _ServiceElsewhere:
    """What jax.distributed keeps as process 0's service when a helper process runs it."""

    def shutdown(self):
        pass


@contextlib.contextmanager
def coordination_service_apart(settings: dict, peer_timeout: float):
    """Process 0: jax.distributed.initialize with JAX's coordination service running in
    a helper process instead of in this one.

    In this process, the service would die with it, and JAX's client in every other
    process then terminates natively (a C++ `Check failure`, exit 134) within a
    second. Hosted apart, it outlives process 0 by a grace period, in which the other
    processes' heartbeat watch sees process 0 silent and stops them with a message
    (exit PEER_LOST). The helper ends a few seconds after process 0 exits normally
    (the others leave JAX's shutdown barrier by then), else after that grace period.
    """
    from jax._src import distributed
    module = getattr(distributed, "_jax", None)
    original = getattr(module, "get_distributed_runtime_service", None)
    address = settings.get("coordinator_address")
    if original is None or not address or settings.get("coordinator_bind_address"):
        yield  # another jaxlib, or an address we do not parse: the service stays here
        return
    port = address.rsplit(":", 1)[1]
    linger = 2 * peer_timeout + 10  # how long a helper outlives a process 0 that was lost
    if not wait_until_free(int(port), linger):
        raise DistributedError(f"the coordinator's port {port} is still in use {linger:g} s "
                               "on: another program listens there; choose another "
                               "--coordinator_address")
    helper = subprocess.Popen([sys.executable, "-c", SERVICE_PROCESS, f"[::]:{port}",
                               str(settings["num_processes"]),
                               str(settings["heartbeat_timeout_seconds"]), str(os.getpid()),
                               str(linger)],
                              start_new_session=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    SERVICE["helper"] = helper

    def stop_service():  # at a normal exit: JAX's shutdown barrier, then the service
        jax.distributed.shutdown()  # goes a few seconds later, when the others are out of
        release_service()  # it too (JAX's own exit handler then has nothing left to do)
    atexit.register(stop_service)
    module.get_distributed_runtime_service = lambda *args, **kwargs: _ServiceElsewhere()
    try:
        yield
    finally:
        module.get_distributed_runtime_service = original


SERVICE = {}  # process 0's helper process hosting the coordination service, if any


def release_service() -> None:
    """Process 0 is leaving with the others (a normal end, or a stop every process agreed
    on): its coordination service ends a few seconds later, when the others are out too,
    instead of after the grace kept for a lost process 0, so that a rerun can start at
    once on the same port."""
    helper = SERVICE.pop("helper", None)
    if helper is not None and helper.poll() is None:
        helper.terminate()


def wait_until_free(port: int, seconds: float) -> bool:
    """Whether a server could listen on TCP `port` within `seconds`: the coordination
    service of the run before (stopped, or its process 0 lost) may hold it that long, and
    a service started beside it would share its connections."""
    deadline = time.monotonic() + seconds
    while True:
        family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(("::" if family == socket.AF_INET6 else "", port))
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
        time.sleep(0.2)


def lost(process: int, why: str, checkpoints: str | None = None) -> None:
    """Ends this process, saying which process of the run was lost and what to do, and
    the newest checkpoint in `checkpoints` (the run's directory, if known)."""
    me, count = jax.process_index(), jax.process_count()
    message = (f"error: process {process} of {count} was lost ({why}); process {me} stops "
               f"too. {supervise.newest_checkpoint(checkpoints)} Rerun every process to "
               "resume.\n")
    os.write(2, message.encode())
    os._exit(PEER_LOST)


PEER_LOST = supervise.PEER_LOST  # another process of the run was lost (EX_TEMPFAIL: rerun all)
HEARTBEAT_KEY = "jaxtrain/heartbeat/"


def watch_peers(peers: PeerWatch) -> None:
    """Starts a daemon thread that stops this process when another one of the run is lost.

    Without it, a process whose peer died waits in the next collective until JAX's
    heartbeat limit and then aborts natively (a C++ `Check failure` dump, exit 134).
    Process 0 being lost is seen the same way: the coordination service runs apart
    from it (coordination_service_apart).
    Every process here writes a counter to the coordination service's key-value store
    several times per `timeout` and reads the others'; a peer whose counter has not
    moved for peers.timeout seconds (or the service itself gone: process 0, which hosts it)
    ends this process with one line naming the lost process and the newest checkpoint,
    and exit status PEER_LOST. Rerunning every process resumes from that checkpoint.
    """
    from jax._src import distributed  # the key-value store has no public API yet
    client = distributed.global_state.client
    if client is None:
        return
    me, count, timeout = jax.process_index(), jax.process_count(), peers.timeout
    interval = max(min(timeout / 5, 2.0), 0.05)

    def watch():
        beats, seen = 0, {}  # peer -> (its last counter, when it last changed)
        service_ok = time.monotonic()
        while True:
            now = time.monotonic()
            try:
                beats += 1
                client.key_value_set(f"{HEARTBEAT_KEY}{me}", str(beats), allow_overwrite=True)
                values = dict(client.key_value_dir_get(HEARTBEAT_KEY))
                service_ok = now
            except Exception:  # the service is gone or unreachable
                if now - service_ok > timeout:
                    lost(0, f"the coordination service it hosts has not answered for "
                            f"{timeout:g} s", peers.checkpoints)
                time.sleep(interval)
                continue
            for peer in range(count):
                if peer == me:
                    continue
                value = values.get(f"{HEARTBEAT_KEY}{peer}")
                last, since = seen.get(peer, (None, now))
                if value != last:
                    seen[peer] = (value, now)
                elif now - since > timeout:
                    lost(peer, f"no heartbeat for {timeout:g} s", peers.checkpoints)
            time.sleep(interval)

    threading.Thread(target=watch, daemon=True, name="jaxtrain-peers").start()

