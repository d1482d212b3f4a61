"""A worker for the standby tests: records how it was started, then acts as its attempt's plan says.

    python -m tests.standby_worker STATE_DIR

Each start writes STATE_DIR/<index>-<attempt>.json: its pid, TF_CONFIG, `__name__`, sys.argv, whether its stdin
is /dev/null, PYTHONUNBUFFERED, whether TensorFlow was imported before this module ran (a standby process
imported it) and the goodput clock's start. On attempt 0 worker 1 SIGKILLs itself once worker 0 has recorded
(worker 0 waits to be stopped); later attempts exit 0.
"""

import json
import os
import signal
import sys
import time

PRELOADED = "tensorflow" in sys.modules  # before anything here imports it


def main(state_dir: str) -> None:
    tf_config = json.loads(os.environ["TF_CONFIG"])
    index = tf_config["task"]["index"]
    attempt = sum(name.startswith(f"{index}-") for name in os.listdir(state_dir))
    from mwloop.run import goodput_clock
    record = {"pid": os.getpid(), "tf_config": tf_config, "name": __name__, "argv": sys.argv,
              "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),
              "unbuffered": os.environ.get("PYTHONUNBUFFERED"), "preloaded": PRELOADED,
              "work_started": goodput_clock._work_started}  # noqa: SLF001 - what the test checks
    path = os.path.join(state_dir, f"{index}-{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    if attempt > 0:
        return
    if index == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(state_dir, "0-0.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # worker 0: until the launcher stops it


if __name__ == "__main__":
    main(sys.argv[1])
