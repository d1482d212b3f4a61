"""Sweep agents on a cluster: a Slurm array job, or a Kubernetes Indexed Job, whose tasks are agents.

Both run the same agent command (`python -m mwloop.sweep agent --study=NAME --storage=URL ...`) N times,
P at a time; each agent asks the shared study for trials until its budget is met, so N agents never
overshoot it. The files rendered here are meant to be read and edited before they are submitted:

  render_sbatch(...)   -> a batch script for ONE `sbatch --array=0-(N-1)%P` job; `submit_sbatch` submits it
  render_k8s_job(...)  -> an Indexed `batch/v1` Job manifest for `kubectl apply -f`

Each trial's own multi-worker training stays inside its agent's allocation (`--num_workers` runs
`mwloop.launch` on the agent's node: give the task the CPUs/GPUs for all its workers). No TensorFlow and no
Optuna here. Bad options are SweepError: one line naming the option and the fix.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence

from mwloop.sweep.values import SweepError

# Set by the render functions themselves; an option may not set them again.
SBATCH_OWN = ("array", "job-name", "output", "error", "open-mode", "ntasks", "chdir", "parsable", "wait")
# A Kubernetes object name (DNS-1123 label): a Job's pods are named <name>-<index>-<random>.
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# 63 minus room for the index and the pod's random suffix.
K8S_NAME_MAX = 52
# A resource quantity (Kubernetes' own pattern): 4, 500m, 1.5, 8Gi, 1e3.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY = re.compile(rf"[+]?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?{_NUMBER}))?")
RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# The storage URL read from a Secret (Kubernetes expands $(VAR) in command).
STORAGE_ENV = "MWLOOP_STORAGE_URL"


def _check_counts(num_agents: int, parallel: int) -> None:
    if not isinstance(num_agents, int) or num_agents < 1:
        raise SweepError(f"--num_agents={num_agents}: give the number of agents in the job, at least 1")
    if not isinstance(parallel, int) or parallel < 1:
        raise SweepError(f"--parallel={parallel}: give how many agents may run at once, at least 1")


def _check_argv(agent_argv: Sequence[str]) -> list[str]:
    argv = [str(arg) for arg in agent_argv]
    if not argv:
        raise SweepError("the agent command is empty")
    bad = next((arg for arg in argv if "\n" in arg or "\0" in arg), None)
    if bad is not None:
        raise SweepError(f"agent argument {bad!r} holds a newline or NUL; a sweep's paths and URLs cannot")
    return argv


def sbatch_lines(options: Mapping[str, str]) -> list[str]:
    """`#SBATCH --key=value` lines for the user's options (a bare `--key` when the value is empty).

    Keys are sbatch's long options with or without their dashes (`gpus`, `cpus-per-task`, `mem`, `time`,
    `partition`, `account`, `gres`, `constraint`, `qos`, ...)."""
    lines = []
    for raw_key, raw_value in options.items():
        key, value = str(raw_key).strip().lstrip("-"), str(raw_value).strip()
        shown = f"--sbatch={raw_key}={raw_value}"
        if "_" in key and re.fullmatch(r"[a-z][a-z0-9_-]*", key):
            raise SweepError(f"{shown}: sbatch options are spelled with dashes: {key.replace('_', '-')}")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
            raise SweepError(f"{shown}: {raw_key!r} is not an sbatch long option (e.g. cpus-per-task, mem, time)")
        if key in SBATCH_OWN:
            raise SweepError(f"{shown}: --{key} is set by the sweep itself (--num_agents, --parallel, the sweep "
                             f"directory); edit the written script to change it")
        if re.search(r"[\s\0]", value):
            raise SweepError(f"{shown}: an #SBATCH value cannot hold spaces or newlines")
        lines.append(f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}")
    return lines


def shell_command(argv: Sequence[str]) -> str:
    """The command shell-quoted, one `--flag` per line (continued with backslashes) so it reads and edits."""
    words = [shlex.quote(arg) for arg in argv]
    return "".join(word if i == 0 else (" \\\n    " if arg.startswith("--") else " ") + word
                   for i, (arg, word) in enumerate(zip(argv, words)))


def render_sbatch(agent_argv: list[str], *, num_agents: int, parallel: int, job_name: str, log_dir: str,
                  options: dict[str, str], chdir: str | None = None) -> str:
    """A Slurm batch script for one array job of `num_agents` tasks, `parallel` at a time, each one agent.

    Args:
      agent_argv: the agent's command (every argument is shell-quoted in the script).
      num_agents: array tasks (agents) in the job.
      parallel: array tasks running at once (`%P`).
      job_name: the job's name (`%x` in log names).
      log_dir: where each task writes `<job_name>-<job id>_<task>.out`. Created here: Slurm does not create
        it, and a task whose output directory is missing fails at once (ExitCode 0:53) with no log at all.
      options: more `#SBATCH` options (gpus, cpus-per-task, mem, time, partition, ...), see `sbatch_lines`.
      chdir: the directory the agents run in, so relative paths in the command hold (default: the current one).

    Returns:
      The script's text. Raises SweepError (one line) for a bad count, name or option.
    """
    _check_counts(num_agents, parallel)
    argv = _check_argv(agent_argv)
    if not job_name or re.search(r"[\s%]", job_name):
        raise SweepError(f"job name {job_name!r}: give a name without spaces or '%'")
    user_lines = sbatch_lines(options)
    chdir = os.path.abspath(chdir or os.getcwd())
    log_dir = os.path.abspath(log_dir)
    if re.search(r"\s", log_dir):
        raise SweepError(f"log directory {log_dir!r}: an #SBATCH path cannot hold spaces; use a sweep directory "
                         "without them")
    command = shell_command(argv)
    parallel = min(parallel, num_agents)
    os.makedirs(log_dir, exist_ok=True)
    return "\n".join([
        "#!/bin/bash",
        "# Agents of an mwloop sweep: one Slurm array job whose tasks each run one agent of the shared study.",
        "# Every agent asks the study for trials until its budget is met (never more in all), runs each trial",
        "# as a training process on this task's node, and reports it back. Edit the #SBATCH lines (resources,",
        "# partition, time) and submit with:",
        "#",
        "#   sbatch THIS_FILE",
        "#",
        "# A trial whose agent ended without reporting it (time limit, preemption, a lost node) is failed by the",
        "# study's heartbeat and retried by another agent, which resumes it from its checkpoint. Logs: the",
        "# --output path below.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --array=0-{num_agents - 1}%{parallel}   # {num_agents} agents, {parallel} at a time",
        "#SBATCH --ntasks=1                # one agent per array task; its trials run inside the task",
        f"#SBATCH --output={log_dir}/%x-%A_%a.out",
        "#SBATCH --open-mode=append        # a requeued task appends to its log",
        *([] if "signal" in {k.strip().lstrip("-") for k in options} else [
            "#SBATCH --signal=B:TERM@120      # 2 min before the time limit: the agent stops its trial (it saves)"]),
        *user_lines,
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(chdir)}",
        "# SLURM_ARRAY_TASK_ID seeds this agent's sampler apart from the others'.",
        f"exec {command}",
        "",
    ])


def submit_sbatch(script_path: str, env: Mapping[str, str] | None = None) -> str:
    """Submits a batch script with `sbatch --parsable`; returns the job id. SweepError (one line) when sbatch
    is missing or refuses the script."""
    try:
        done = subprocess.run(["sbatch", "--parsable", script_path], env=None if env is None else dict(env),
                              capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SweepError("sbatch is not on PATH: submit from a Slurm login node, or run the sweep with "
                         "--backend=local") from None
    except subprocess.TimeoutExpired:
        raise SweepError(f"sbatch {script_path} did not answer in 120 s: is slurmctld up? (scontrol ping)") from None
    if done.returncode:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"]
        raise SweepError(f"sbatch {script_path} refused the job: {lines[-1]}")
    return done.stdout.strip().split(";")[0]  # "<id>[;<cluster>]"


def _check_resources(resources: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for key, value in resources.items():
        key, value = str(key).strip(), str(value).strip()
        if not RESOURCE_NAME.fullmatch(key):
            raise SweepError(f"--resource={key}={value}: {key!r} is not a resource name (cpu, memory, "
                             "ephemeral-storage, nvidia.com/gpu)")
        if not QUANTITY.fullmatch(value):
            raise SweepError(f"--resource={key}={value}: {value!r} is not a quantity (e.g. 4, 500m, 8Gi)")
        checked[key] = value
    return checked


def _secret_env(storage_secret: str, argv: list[str]) -> tuple[list[str], list[dict]]:
    """The argv with its --storage value read from a Secret at run time, and the env entry that does it."""
    secret, _, key = storage_secret.partition(":")
    if not K8S_NAME.fullmatch(secret) or (key and not re.fullmatch(r"[-._a-zA-Z0-9]+", key)):
        raise SweepError(f"storage secret {storage_secret!r}: give SECRET[:KEY], a Secret's name and its key")
    if not any(arg.startswith("--storage=") for arg in argv):
        raise SweepError("the agent command has no --storage=URL to read from the Secret")
    argv = [f"--storage=$({STORAGE_ENV})" if arg.startswith("--storage=") else arg for arg in argv]
    env = [{"name": STORAGE_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": key or "url"}}}]
    return argv, env


def render_k8s_job(agent_argv: list[str], *, num_agents: int, parallel: int, name: str, image: str,
                   resources: dict[str, str], storage_secret: str = "", volume_claim: str = "",
                   mount_path: str = "") -> str:
    """An Indexed `batch/v1` Job whose `num_agents` pods (`parallel` at a time) each run one agent.

    Args:
      agent_argv: the container's command: the agent with its --storage URL (a database every pod reaches).
      num_agents, parallel: the Job's completions and parallelism.
      name: the Job's name (a DNS-1123 label of at most 52 characters).
      image: a container image with this mwloop (and the sweep's configs) installed.
      resources: per pod, both requested and limited (cpu, memory, nvidia.com/gpu: all of a trial's workers).
      storage_secret: SECRET[:KEY] (key default `url`): the storage URL is read from this Secret at run time
        instead of being written into the manifest (it holds the database's password).
      volume_claim, mount_path: a ReadWriteMany PersistentVolumeClaim mounted at `mount_path` in every pod;
        the sweep directory (--workdir) must be on it, so trials resume from their checkpoints on any pod.

    Returns:
      The manifest's YAML, with a comment on how to apply it. Raises SweepError (one line) for bad input.
    """
    import yaml  # ml_collections' own dependency

    _check_counts(num_agents, parallel)
    argv = _check_argv(agent_argv)
    if not image or re.search(r"\s", image):
        raise SweepError(f"--image={image!r}: give the container image with mwloop installed (e.g. "
                         "registry.example.com/mwloop:latest)")
    if len(name) > K8S_NAME_MAX or not K8S_NAME.fullmatch(name):
        raise SweepError(f"job name {name!r}: a Kubernetes name is lower-case letters, digits and '-', "
                         f"at most {K8S_NAME_MAX} characters")
    limits = _check_resources(resources)
    env: list[dict] = []
    if storage_secret:
        argv, env = _secret_env(storage_secret, argv)
    if bool(volume_claim) != bool(mount_path):
        raise SweepError("give both a volume claim and its mount path (the sweep directory's file system), or "
                         "neither")
    # Kubernetes expands $(VAR) in a command; $$ keeps a literal one (only the storage Secret's is meant).
    argv = [arg if arg == f"--storage=$({STORAGE_ENV})" else arg.replace("$(", "$$(") for arg in argv]
    container: dict = {"name": "agent", "image": image, "command": argv}
    if env:
        container["env"] = env
    if limits:
        container["resources"] = {"requests": dict(limits), "limits": dict(limits)}
    pod_spec: dict = {"restartPolicy": "Never", "containers": [container]}
    if volume_claim:
        if not K8S_NAME.fullmatch(volume_claim) or not mount_path.startswith("/"):
            raise SweepError(f"volume claim {volume_claim!r} at {mount_path!r}: give a claim name and an "
                             "absolute mount path")
        container["volumeMounts"] = [{"name": "sweep", "mountPath": mount_path}]
        pod_spec["volumes"] = [{"name": "sweep", "persistentVolumeClaim": {"claimName": volume_claim}}]
    labels = {"app.kubernetes.io/name": "mwloop-sweep", "app.kubernetes.io/instance": name}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            # JOB_COMPLETION_INDEX seeds each agent's sampler apart.
            "completionMode": "Indexed",
            "completions": num_agents,
            "parallelism": min(parallel, num_agents),
            # Pods lost to node failures are replaced; their trials are retried.
            "backoffLimit": num_agents,
            # dict(labels): a copy, so the YAML has no anchors.
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }
    header = [
        "# Agents of an mwloop sweep: an Indexed Job whose pods each run one agent of the shared study.",
        "# Every agent asks the study for trials until its budget is met and runs each as a training process",
        "# in its pod. The storage URL must be a database every pod reaches (PostgreSQL); the sweep directory",
        "# (--workdir) must be on a volume every pod mounts (ReadWriteMany), so a retried trial resumes from",
        "# its checkpoint. Edit as needed, then:",
        "#",
        "#   kubectl apply -f THIS_FILE",
        f"#   kubectl logs -f --prefix -l app.kubernetes.io/instance={name}",
    ]
    if not volume_claim:
        header.append("# No volume is mounted yet: add one under volumes/volumeMounts for the sweep directory.")
    return "\n".join(header) + "\n" + yaml.safe_dump(job, sort_keys=False, default_flow_style=False, width=120)
