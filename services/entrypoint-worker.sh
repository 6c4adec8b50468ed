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
#   FLODL_CREDENTIALS    a file of the run's worker credentials, KEY=VALUE lines (compose:
#                        the credentials service writes it): FLODL_RUN,
#                        FLODL_REDIS_USERNAME, FLODL_REDIS_PASSWORD, FLODL_RUN_SECRET;
#                        what it sets wins over the environment
set -eu

if [ -n "${FLODL_CREDENTIALS:-}" ]; then
  if [ ! -r "$FLODL_CREDENTIALS" ]; then
    echo "worker: no credentials at $FLODL_CREDENTIALS (compose's credentials service writes them)" >&2
    exit 2
  fi
  set -a
  . "$FLODL_CREDENTIALS"
  set +a
fi

if ! mkdir -p runs 2>/dev/null || [ ! -w runs ]; then
  echo "worker: $(pwd)/runs is not writable by uid $(id -u) (owner $(stat -c %u:%g runs 2>/dev/null)): compose's init service hands it over; by hand, chown it to this uid" >&2
  exit 2
fi

if [ -z "${FLODL_RUN:-}" ] && [ -s runs/.compose-run ]; then
  FLODL_RUN=$(cat runs/.compose-run)
fi
: "${FLODL_RUN:?set FLODL_RUN to the run id (or start the coordinator first)}"

set -- flodl-bus worker --run "$FLODL_RUN"
if [ -n "${FLODL_JOB:-}" ]; then set -- "$@" --job "$FLODL_JOB"; fi
if [ -n "${FLODL_MODE:-}" ]; then set -- "$@" --mode "$FLODL_MODE"; fi

# shellcheck disable=SC2086  # FLODL_WORKER_ARGS is a list of flags
exec "$@" ${FLODL_WORKER_ARGS:-}
