#!/usr/bin/env bash
# The Debian packages of the services the tests bring up themselves (tests/services/): PostgreSQL,
# Slurm with munge, and etcd (etcd-server holds only the daemon; etcdctl is in etcd-client, which no
# test needs). Idempotent: when all are installed it returns at once, without touching apt.
# The tests start their own daemons in temp dirs; nothing here configures or starts a system service.
set -euo pipefail
packages=(postgresql slurm-wlm munge etcd-server)
missing=()
for package in "${packages[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" != "install ok installed" ]]; then
    missing+=("$package")
  fi
done
if (( ${#missing[@]} == 0 )); then
  exit 0
fi
sudo=()
if (( EUID != 0 )); then
  command -v sudo >/dev/null || { echo "error: installing ${missing[*]} needs root (or sudo)" >&2; exit 1; }
  sudo=(sudo -n)  # never wait for a password: fail at once with sudo's own message
fi
echo "+ apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
