"""A stand-in worker for launcher tests: no TensorFlow, starts in milliseconds.

    python -m tests.fake_worker STATE_DIR PLAN_0 PLAN_1 ...

PLAN_i is worker i's action on each attempt, comma-separated (the last one
repeats): `ok` (exit 0), `exitN` (exit N), `kill9` (SIGKILL itself), `sleep`
(wait to be stopped), `hang` (wait, ignoring SIGTERM), `saveN` (like mwloop.main
under Ctrl-C: on SIGINT or the launcher's forwarded Ctrl-C, "save" for N
seconds, then exit 130; a second SIGINT exits 130 at once). Each start records its
pid and TF_CONFIG in STATE_DIR/<index>-<attempt>.json. A worker about to fail
first waits until every worker has recorded its start, so the launcher never
stops a worker before it has recorded (and attempts stay numbered alike).
"""

import json
import os
import signal
import sys
import time

from mwloop import errors


def record(state_dir: str, index: int, tf_config: dict) -> int:
    """Writes this start's record (whole or not at all); returns the attempt number."""
    attempt = sum(name.startswith(f"{index}-") and name.endswith(".json") for name in os.listdir(state_dir))
    path = os.path.join(state_dir, f"{index}-{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "tf_config": tf_config}, f)
    os.replace(path + ".tmp", path)
    return attempt


def wait_for_all(state_dir: str, num_workers: int, attempt: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(state_dir, f"{i}-{attempt}.json")) for i in range(num_workers)):
        time.sleep(0.01)


def main(state_dir: str, plans: list[str]) -> None:
    tf_config = json.loads(os.environ["TF_CONFIG"])
    index = tf_config["task"]["index"]
    actions = plans[index].split(",")
    if "hang" in actions:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before recording: the launcher may stop us right after
    interrupts: list[str] = []
    if any(a.startswith("save") for a in actions):
        def on_interrupt(signum, frame):
            if signum == signal.SIGINT and "SIGINT" in interrupts:  # only a second SIGINT: see mwloop.run.preemption
                print(f"{index}: SIGINT again: exiting now", flush=True)
                os._exit(errors.INTERRUPTED)
            interrupts.append(signal.Signals(signum).name)
        for signum in (signal.SIGINT, errors.INTERRUPT_SIGNAL):
            signal.signal(signum, on_interrupt)
    attempt = record(state_dir, index, tf_config)
    action = actions[min(attempt, len(actions) - 1)]
    if action != "hang":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(f"hello from {index} attempt {attempt}: {action}", flush=True)
    print(f"to stderr from {index}", file=sys.stderr, flush=True)
    if action == "ok":
        sys.exit(0)
    wait_for_all(state_dir, len(tf_config["cluster"]["worker"]), attempt)
    if action.startswith("exit"):
        sys.exit(int(action[len("exit"):]))
    if action == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("save"):
        while not interrupts:
            time.sleep(0.01)
        print(f"{index}: interrupted by {interrupts[0]}; saving", flush=True)
        time.sleep(float(action[len("save"):]))
        print(f"{index}: saved after {'+'.join(interrupts)}", flush=True)
        sys.exit(errors.INTERRUPTED)
    time.sleep(120)  # sleep / hang: until the launcher stops this worker
    sys.exit(5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
