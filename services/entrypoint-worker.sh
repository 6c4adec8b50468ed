#!/bin/sh
# One worker of a compose run. It has no rank: it dials in through the run's join stream
# and the coordinator assigns ranks in arrival order, so `docker compose up --scale
# worker=N` needs no per-replica configuration. The job, the mode, the save path and
# the resume point are the coordinator's unless set here.
#
#   FLODL_RUN            run id (default: the one the coordinator wrote to runs/.compose-run)
#   FLODL_REDIS_URL      redis://redis:6379/0 in compose
#   FLODL_JOB, FLODL_MODE    only to pin them (a mismatch is refused at join)
#   FLODL_WORKER_ARGS    extra flags, appended as is
set -eu

if [ -z "${FLODL_RUN:-}" ] && [ -s runs/.compose-run ]; then
  FLODL_RUN=$(cat runs/.compose-run)
fi
: "${FLODL_RUN:?set FLODL_RUN to the run id (or start the coordinator first)}"

set -- flodl-bus worker --run "$FLODL_RUN"
if [ -n "${FLODL_JOB:-}" ]; then set -- "$@" --job "$FLODL_JOB"; fi
if [ -n "${FLODL_MODE:-}" ]; then set -- "$@" --mode "$FLODL_MODE"; fi

# shellcheck disable=SC2086  # FLODL_WORKER_ARGS is a list of flags
exec "$@" ${FLODL_WORKER_ARGS:-}
