"""Strategy creation and cluster facts: who trains, who is chief, where to write.

Everything here runs before any other TensorFlow op, because logical devices
and collective ops can only be configured before the runtime starts.
Joining a cluster runs under `startup.watchdog`, which names missing tasks and
enforces config.distribution.startup_timeout_s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import ml_collections
import tensorflow as tf
from absl import logging
from tensorflow.python.eager import context

from mwloop.cluster import agreement, startup
from mwloop.config import check as config_check
from mwloop.errors import UserError

TASK_TYPES = ("chief", "worker", "evaluator", "ps")
COLLECTIVES = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


class ClusterConfigError(UserError):
    """A cluster description (TF_CONFIG or Slurm) that cannot be used."""


def parse_tf_config(raw: str | None = None) -> dict | None:
    """Returns the validated TF_CONFIG dict, or None when it is unset or empty.

    Raises ClusterConfigError with a one-line message naming the problem.
    """
    raw = os.environ.get("TF_CONFIG", "") if raw is None else raw
    if not raw.strip():
        return None
    fix = ("fix TF_CONFIG, e.g. '{\"cluster\": {\"worker\": [\"host0:port\", \"host1:port\"]}, "
           "\"task\": {\"type\": \"worker\", \"index\": 0}}'")
    try:
        tf_config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON ({e.msg} at char {e.pos}); {fix}") from None
    if not isinstance(tf_config, dict):
        raise ClusterConfigError(f"TF_CONFIG must be a JSON object; {fix}")
    cluster = tf_config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterConfigError(f"TF_CONFIG has no 'cluster' object; {fix}")
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise ClusterConfigError(
                f"TF_CONFIG cluster has unknown task type {task_type!r} (known: {', '.join(TASK_TYPES)}); {fix}")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ClusterConfigError(f"TF_CONFIG cluster[{task_type!r}] must be a list of 'host:port' strings; {fix}")
        for address in addresses:
            if not address.rpartition(":")[2].isdigit():
                raise ClusterConfigError(f"TF_CONFIG cluster[{task_type!r}] address {address!r} is not 'host:port'")
    if "ps" in cluster and "chief" not in cluster:
        raise ClusterConfigError("TF_CONFIG lists 'ps' tasks but no 'chief': parameter-server training needs a "
                                 "chief task (the coordinator that runs the loop); add cluster['chief']")
    if "ps" in cluster and "worker" not in cluster:
        raise ClusterConfigError("TF_CONFIG lists 'ps' tasks but no 'worker' tasks: parameter-server training "
                                 "needs workers to run the steps; add cluster['worker']")
    if "chief" in cluster and len(cluster["chief"]) != 1:
        raise ClusterConfigError(f"TF_CONFIG cluster['chief'] must list exactly one address, "
                                 f"got {len(cluster['chief'])}")
    task = tf_config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterConfigError(f"TF_CONFIG has no 'task' with 'type' and 'index'; {fix}")
    task_type, index = task["type"], task["index"]
    if task_type not in TASK_TYPES:
        raise ClusterConfigError(f"TF_CONFIG task type {task_type!r} is unknown (known: {', '.join(TASK_TYPES)})")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ClusterConfigError(f"TF_CONFIG task index {index!r} is not a non-negative integer")
    if task_type == "evaluator" and "evaluator" not in cluster:
        # TensorFlow lets the evaluator stay outside the training cluster.
        return tf_config
    if task_type not in cluster:
        raise ClusterConfigError(f"TF_CONFIG task type {task_type!r} is not in the cluster ({', '.join(cluster)})")
    if index >= len(cluster[task_type]):
        raise ClusterConfigError(
            f"TF_CONFIG task index {index!r} is outside cluster[{task_type!r}] "
            f"(valid: 0..{len(cluster[task_type]) - 1})")
    return tf_config


# Set by the elastic launcher (mwloop.launcher.elastic) to its bounds, "MIN:MAX": the run must work with any worker
# count in between, and a worker given notice leaves the job (errors.LEAVING) instead of restarting with it.
ELASTIC_ENV = "MWLOOP_ELASTIC_WORKERS"


def elastic_worker_counts() -> range | None:
    """The worker counts an elastic job may train with (MIN..MAX), or None outside an elastic job."""
    text = os.environ.get(ELASTIC_ENV, "")
    if not text:
        return None
    low, high = (int(part) for part in text.split(":"))
    return range(low, high + 1)


def eager_context_started() -> bool:
    """Whether TensorFlow's eager runtime has started (an op ran): a multi-worker strategy must be made before."""
    # No public API tells; TensorFlow's own tests read the same handle.
    return context.context()._context_handle is not None


def slurm_configured() -> bool:
    """Whether this process runs as a Slurm task of a multi-task job."""
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def cluster_configured() -> bool:
    """Whether TF_CONFIG or Slurm describes a multi-process cluster."""
    tf_config = parse_tf_config()
    if tf_config is not None:
        return sum(len(v) for k, v in tf_config["cluster"].items() if k in ("chief", "worker")) > 1 or (
            "evaluator" in tf_config["cluster"])
    return slurm_configured()


def ps_cluster() -> bool:
    """Whether TF_CONFIG describes a parameter-server cluster (it lists `ps` tasks)."""
    tf_config = parse_tf_config()
    return bool(tf_config) and "ps" in tf_config["cluster"]


def task_type() -> str:
    """This process's task type: 'chief', 'worker' or 'evaluator' ('worker' when no cluster)."""
    tf_config = parse_tf_config()
    return tf_config["task"]["type"] if tf_config else "worker"


def cluster_has_evaluator() -> bool:
    """Whether TF_CONFIG lists an evaluator task (then it, not the trainers, evaluates)."""
    tf_config = parse_tf_config()
    return bool(tf_config) and ("evaluator" in tf_config["cluster"] or tf_config["task"]["type"] == "evaluator")


def is_evaluator() -> bool:
    """Whether TF_CONFIG makes this process the side-car evaluator: it must not
    train, only evaluate the chief's checkpoints as they appear."""
    return task_type() == "evaluator"


def configure_cpu_devices(num_cpu_devices: int) -> None:
    """Splits the first CPU into `num_cpu_devices` logical devices (must run before any op)."""
    if num_cpu_devices <= 1:
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_cpu_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices)
    except RuntimeError:
        raise RuntimeError(
            f"cannot split the CPU into {num_cpu_devices} devices after TensorFlow has started "
            f"(it has {len(current or [cpu])}); create the strategy first, in a fresh process") from None


def _slurm_resolver() -> tf.distribute.cluster_resolver.ClusterResolver:
    """TensorFlow's SlurmClusterResolver; on nodes without GPUs, its cluster and task only.

    The resolver counts GPUs with nvidia-smi and gives each task its own GPUs
    (no GPUs: no tasks), so on GPU-less nodes it gets one pretend GPU per task,
    assigns none, and only its cluster spec and task are kept.
    """
    if shutil.which("nvidia-smi") or "CUDA_VISIBLE_DEVICES" in os.environ:
        return tf.distribute.cluster_resolver.SlurmClusterResolver()
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
        gpus_per_node=int(os.environ["SLURM_NTASKS"]), gpus_per_task=1, auto_set_gpu=False)
    cluster_spec = slurm.cluster_spec()  # also sets task_type and task_id
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec, task_type=slurm.task_type, task_id=slurm.task_id, num_accelerators={}, rpc_layer="grpc")


def _cluster_resolver() -> tf.distribute.cluster_resolver.ClusterResolver:
    if parse_tf_config() is not None:
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if slurm_configured():
        return _slurm_resolver()
    raise ClusterConfigError(
        "strategy 'multi_worker' needs a cluster: set TF_CONFIG on every worker, run under Slurm, "
        "or use `python -m mwloop.launch --num_workers=N -- ...`")


def check_can_listen(resolver: tf.distribute.cluster_resolver.ClusterResolver) -> None:
    """Raises ClusterConfigError if this task's port cannot be bound.

    TensorFlow's server would fail later with a traceback that does not name
    the port, leaving the other tasks waiting. It binds every interface
    ("[::]:port", SO_REUSEADDR), whatever host TF_CONFIG names, so this binds
    the same: no DNS look-up, and the check holds for remote-looking names too.
    """
    task_type, index = resolver.task_type, resolver.task_id
    address = resolver.cluster_spec().task_address(task_type, index)
    port = startup.host_port(address)[1]
    if not port:
        return
    dual = socket.has_dualstack_ipv6()
    try:
        socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                             dualstack_ipv6=dual).close()
    except OSError as e:
        reason = os.strerror(e.errno).lower() if e.errno else str(e)
        raise ClusterConfigError(f"{startup.task_name(task_type, index)} cannot listen on {address} ({reason}); "
                                 f"free the port or pick another in TF_CONFIG") from None


def _first_all_reduce(strategy: tf.distribute.Strategy) -> None:
    """One all-reduce over every replica: it returns once every worker has joined the collectives."""
    ones = strategy.experimental_distribute_values_from_function(lambda _: tf.constant(1.0))
    strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)


def create_strategy(dist: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    """Creates the strategy named by `dist.strategy`; call before any other TF op."""
    name = dist.strategy
    # Also for callers that skipped config_check.check.
    for key in ("strategy", "collective", "bytes_per_pack"):
        if key in dist:
            config_check.check_value(f"distribution.{key}", dist[key])
    # Also validates TF_CONFIG, before anything else happens.
    evaluator = is_evaluator()
    if name == "auto" or (evaluator and name in ("multi_worker", "parameter_server")):
        # The evaluator never joins the training collectives: a local strategy.
        # The cluster is checked before the GPUs are listed: listing initialises
        # CUDA, after which SlurmClusterResolver can no longer assign GPUs to tasks.
        name = ("parameter_server" if ps_cluster() else "multi_worker") if cluster_configured() and not evaluator \
            else _local_auto(dist)
    _warn_unused_cpu_split(name, dist)
    if name == "multi_worker" and ps_cluster():
        raise UserError("TF_CONFIG lists 'ps' tasks, which strategy 'multi_worker' cannot use; set "
                        "config.distribution.strategy='parameter_server' (or 'auto')")
    if name == "parameter_server":
        return _parameter_server_strategy(dist)
    if name == "multi_worker":
        resolver = _cluster_resolver()
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=COLLECTIVES[dist.collective],
            timeout_seconds=dist.collective_timeout_s or None, bytes_per_pack=dist.get("bytes_per_pack", 0))
        check_can_listen(resolver)
        configure_cpu_devices(dist.num_cpu_devices)
        # Both wait for every task: creation until all have registered with the coordination service
        # (the C++ wait that holds the GIL), the all-reduce until all have joined the collectives.
        with startup.watchdog(resolver, dist.get("startup_timeout_s", 300.0)):
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options)
            # Before the first collective: a worker told of another cluster would abort it with a traceback.
            agreement.check_environment(strategy, chief=is_chief(strategy),
                                        timeout_s=dist.get("startup_timeout_s", 300.0))
            _first_all_reduce(strategy)
        return strategy
    configure_cpu_devices(dist.num_cpu_devices)
    if name == "default":
        return tf.distribute.get_strategy()
    gpus = tf.config.list_logical_devices("GPU")
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
    devices = [d.name for d in gpus] or [d.name for d in tf.config.list_logical_devices("CPU")]
    return tf.distribute.MirroredStrategy(devices)


def _local_auto(dist: ml_collections.ConfigDict) -> str:
    """Strategy `auto` without a cluster: mirrored over several GPUs, or over the CPU split into
    num_cpu_devices > 1 devices (splitting the CPU is only ever asked for to get replicas); else default."""
    if len(tf.config.list_physical_devices("GPU")) > 1 or dist.num_cpu_devices > 1:
        return "mirrored"
    return "default"


def _warn_unused_cpu_split(name: str, dist: ml_collections.ConfigDict) -> None:
    """One warning line when num_cpu_devices > 1 gives the strategy no more replicas: a split CPU and a
    single-replica run used to look alike."""
    count = dist.num_cpu_devices
    if count <= 1 or (name == "mirrored" and not tf.config.list_physical_devices("GPU")):
        return
    why = {"multi_worker": "MultiWorkerMirroredStrategy trains one replica per CPU worker: more workers give more "
                           "replicas (python -m mwloop.launch --num_workers=N on one machine)",
           "parameter_server": "under parameter servers each worker runs whole steps on its own CPU",
           "mirrored": "MirroredStrategy replicates over the GPUs, not the CPU devices (CUDA_VISIBLE_DEVICES= hides "
                       "the GPUs)"}.get(name, f"strategy {name!r} has one replica: set "
                                          f"config.distribution.strategy=mirrored (or auto) for {count}")
    logging.warning("config.distribution.num_cpu_devices=%d gives no more replicas: %s", count, why)


def _parameter_server_strategy(dist: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    """The chief's ParameterServerStrategy: the chief coordinates; workers and ps tasks only run servers
    (`mwloop.loop.ps.serve`). No variable_partitioner: its ShardedVariables do not work with Keras 3
    (docs/multi_worker.md, "Parameter servers"); tasks split big tables themselves."""
    if not ps_cluster():
        raise ClusterConfigError(
            "config.distribution.strategy='parameter_server' needs TF_CONFIG with 'chief', 'worker' and 'ps' "
            "tasks; run `python -m mwloop.launch --num_workers=N --num_ps=M -- ...`, or set TF_CONFIG")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type != "chief":
        raise ClusterConfigError(f"TF_CONFIG task {resolver.task_type} {resolver.task_id} of a parameter-server "
                                 f"cluster runs a server, not the training loop: start it with mwloop.main")
    check_can_listen(resolver)
    # The constructor connects to every worker and ps (retrying until their servers are up).
    with startup.watchdog(resolver, dist.get("startup_timeout_s", 300.0)):
        return tf.distribute.experimental.ParameterServerStrategy(resolver)


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` is a ParameterServerStrategy (the chief coordinates, workers run scheduled steps)."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes checkpoints, summaries and metric files (never the evaluator)."""
    return strategy.extended.should_checkpoint and not is_evaluator()


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Number of processes running the Trainer in step (1 for single-process strategies, and under parameter
    servers, where only the chief runs it and the workers run the steps it schedules)."""
    if is_parameter_server(strategy):
        return 1
    return getattr(strategy.extended, "_num_workers", 1)


def broadcast_from_chief(strategy: tf.distribute.Strategy, values: list[float]) -> list[bool]:
    """The chief's `values` (flags as 0.0 / 1.0) on every worker: one small all-reduce in which only global
    replica 0, which lives on the chief, contributes. Every worker must call it (it is a collective)."""
    def replica_fn(x):
        first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
        return tf.where(first, x, tf.zeros_like(x))
    vector = tf.constant(values, tf.float32)
    summed = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_fn, args=(vector,)), axis=None)
    return [v > 0.5 for v in summed.numpy().tolist()]
