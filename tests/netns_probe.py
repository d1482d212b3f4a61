"""A stand-in worker for tests/test_signals.py's network test: prints its network namespace and exits."""

import os

if __name__ == "__main__":
    print(f"netns {os.readlink('/proc/self/ns/net')}", flush=True)
