#!/bin/sh
# Compose's `credentials` service, run once per `up` before the coordinator: it makes the
# run's own Redis users (`flodl-bus acl create`, ops/README.md "Per-run users") and hands
# each service only what its role needs, through a volume only that service mounts:
#
#   $FLODL_COORDINATOR_CREDENTIALS/coordinator.env, observer.env   the coordinator's volume
#   $FLODL_WORKER_CREDENTIALS/worker.env                           the workers' volume
#
# Each file holds FLODL_RUN, FLODL_REDIS_USERNAME, FLODL_REDIS_PASSWORD and (coordinator,
# worker) FLODL_RUN_SECRET; mode 0600. This is the only service that holds the admin
# user, which may make any Redis user: the coordinator and the workers never see it.
#
#   FLODL_RUN            run id (default: a fresh compose-<UTC time>-<random> per `up`)
#   FLODL_REDIS_URL      redis://redis:6379/0 in compose
#   FLODL_REDIS_USERNAME, FLODL_REDIS_PASSWORD   the admin (flodl-admin of ops/compose.acl)
#
# The previous `up`'s run users are dropped when the run id changes; with the same id
# they are made again with new passwords (--replace), which cuts any client of the old.
set -eu
umask 077

coord_dir=${FLODL_COORDINATOR_CREDENTIALS:?set FLODL_COORDINATOR_CREDENTIALS to a directory}
worker_dir=${FLODL_WORKER_CREDENTIALS:?set FLODL_WORKER_CREDENTIALS to a directory}

if [ -z "${FLODL_RUN:-}" ]; then
  # a fresh id per `up`: a reused one would put two runs under one run id
  FLODL_RUN="compose-$(date -u +%Y%m%d-%H%M%S)-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
fi

prev=$(sed -n 's/^FLODL_RUN=//p' "$coord_dir/coordinator.env" 2>/dev/null || true)
if [ -n "$prev" ] && [ "$prev" != "$FLODL_RUN" ]; then
  flodl-bus acl drop "$prev" || echo "credentials: the users of run $prev stay in Redis" >&2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flodl-bus acl create "$FLODL_RUN" --replace --env-dir "$tmp"

# A copy beside the target, then a rename: a reader never sees half a file.
place() {
  cp "$tmp/$1" "$2/.$1.new"
  mv -f "$2/.$1.new" "$2/$1"
}
place coordinator.env "$coord_dir"
place observer.env "$coord_dir"
place worker.env "$worker_dir"
echo "credentials: run $FLODL_RUN: users flodl-$FLODL_RUN-{coordinator,worker,observer}, each service holds only its own"
