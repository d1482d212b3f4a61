"""A stand-in worker for launcher tests: no TensorFlow, starts in milliseconds.

    python -m tests.fake_worker STATE_DIR PLAN_0 PLAN_1 ...

PLAN_i is worker i's action on each attempt, comma-separated (the last one
repeats): `ok` (exit 0), `exitN` (exit N), `kill9` (SIGKILL itself), `sleep`
(wait to be stopped), `hang` (wait, ignoring SIGTERM). Each start records its
pid and TF_CONFIG in STATE_DIR/<index>-<attempt>.json.
"""

import json
import os
import signal
import sys
import time


def main(state_dir: str, plans: list[str]) -> None:
    tf_config = json.loads(os.environ["TF_CONFIG"])
    index = tf_config["task"]["index"]
    attempt = sum(name.startswith(f"{index}-") for name in os.listdir(state_dir))
    with open(os.path.join(state_dir, f"{index}-{attempt}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "tf_config": tf_config}, f)
    actions = plans[index].split(",")
    action = actions[min(attempt, len(actions) - 1)]
    print(f"hello from {index} attempt {attempt}: {action}", flush=True)
    print(f"to stderr from {index}", file=sys.stderr, flush=True)
    if action == "ok":
        sys.exit(0)
    if action.startswith("exit"):
        sys.exit(int(action[len("exit"):]))
    if action == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)  # sleep / hang: until the launcher stops this worker
    sys.exit(5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
