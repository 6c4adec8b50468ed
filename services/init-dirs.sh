#!/bin/sh
# Compose's `init` service: the one step that runs as root. It runs before any other
# flodl service and leaves each directory the services write owned by the uid:gid they
# run as, so nothing is left for Docker to create root-owned.
#
#   init-dirs.sh SHARED_DIR [PRIVATE_DIR...]
#
#   SHARED_DIR   ./runs on the host (bind-mounted at /app/runs): made if missing, handed
#                to FLODL_UID:FLODL_GID when it belongs to anyone else (Docker makes a
#                missing bind-mount source as root), mode u+rwx; its contents are left as
#                they are
#   PRIVATE_DIR  a credentials volume: the same owner, mode 0700
#   FLODL_UID, FLODL_GID   the services' user (compose's `user:`), numbers
#
# It ends with an error, and compose starts nothing after it, when a directory still is
# not the services' afterwards (a rootless or user-namespaced daemon may refuse chown).
set -eu

uid=${FLODL_UID:?set FLODL_UID to the services uid}
gid=${FLODL_GID:?set FLODL_GID to the services gid}
case "$uid:$gid" in
  *[!0-9:]* | :* | *:) echo "init: FLODL_UID and FLODL_GID must be numbers, got $uid:$gid" >&2; exit 2 ;;
esac
[ "$#" -ge 1 ] || { echo "usage: init-dirs.sh SHARED_DIR [PRIVATE_DIR...]" >&2; exit 2; }

own() {
  mkdir -p "$1"
  was=$(stat -c %u:%g "$1")
  if [ "$was" != "$uid:$gid" ]; then
    chown "$uid:$gid" "$1"
    echo "init: $1 was $was, now $uid:$gid"
  fi
  chmod "$2" "$1"
  now=$(stat -c %u:%g "$1")
  if [ "$now" != "$uid:$gid" ]; then
    echo "init: $1 belongs to $now, not to the services ($uid:$gid): fix its owner on the host" >&2
    exit 1
  fi
}

own "$1" u+rwx
shift
for dir in "$@"; do
  own "$dir" 0700
done
