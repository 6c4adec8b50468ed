#!/bin/sh
# The coordinator of a compose run. Configuration comes from the environment so the
# command line holds no credentials (they are read from FLODL_REDIS_USERNAME and
# FLODL_REDIS_PASSWORD by the process itself):
#
#   FLODL_RUN            run id (default: a fresh compose-<UTC time>-<random> per start,
#                        written to runs/.compose-run for the workers and the health check)
#   FLODL_REDIS_URL      redis://redis:6379/0 in compose
#   FLODL_JOB            MODULE:NAME (default: the digits example)
#   FLODL_MODE           cpu-cadence | cpu-sync | cpu-async | nccl-cadence | nccl-sync
#   FLODL_WORLD_SIZE     form the world when this many workers joined; when unset, form
#                        it with everyone who joined within FLODL_JOIN_TIMEOUT seconds
#                        (at least FLODL_MIN_WORKERS), which is what --scale needs
#   FLODL_EPOCHS, FLODL_SAVE_PATH, FLODL_RESUME, FLODL_EVAL_EVERY, FLODL_RUN_DIR
#   FLODL_CONFIG         a run.toml of run settings (seed, anchor, outer, ...; see
#                        `flodl-bus coordinator --help`), e.g. runs/run.toml; the ranks
#                        read them from the run's meta
#   FLODL_COORDINATOR_ARGS   extra flags, appended as is
#   FLODL_CREDENTIALS    a file of this run's own credentials, KEY=VALUE lines (compose:
#                        the credentials service writes it): FLODL_RUN,
#                        FLODL_REDIS_USERNAME, FLODL_REDIS_PASSWORD, FLODL_RUN_SECRET;
#                        what it sets wins over the environment
set -eu

if [ -n "${FLODL_CREDENTIALS:-}" ]; then
  if [ ! -r "$FLODL_CREDENTIALS" ]; then
    echo "coordinator: no credentials at $FLODL_CREDENTIALS (compose's credentials service writes them)" >&2
    exit 2
  fi
  set -a
  . "$FLODL_CREDENTIALS"
  set +a
fi

# Records, metrics and checkpoints go under runs/: say so now if this uid cannot write
# there (a bind-mounted ./runs that Docker made for root), not at the first record.
if ! mkdir -p runs 2>/dev/null || [ ! -w runs ]; then
  echo "coordinator: $(pwd)/runs is not writable by uid $(id -u) (owner $(stat -c %u:%g runs 2>/dev/null)): compose's init service hands it over; by hand, chown it to this uid" >&2
  exit 2
fi

if [ -z "${FLODL_RUN:-}" ]; then
  # A fresh id per `up`: a reused one would put two runs under one run id (the records
  # would rotate to runs/<run>.2, but metrics and checkpoints would not).
  FLODL_RUN="compose-$(date -u +%Y%m%d-%H%M%S)-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
  printf '%s\n' "$FLODL_RUN" > runs/.compose-run
fi
export FLODL_RUN

set -- flodl-bus coordinator \
  --run "$FLODL_RUN" \
  --job "${FLODL_JOB:-flodl_bus.examples.digits:job}" \
  --mode "${FLODL_MODE:-cpu-cadence}" \
  --run-dir "${FLODL_RUN_DIR:-runs/$FLODL_RUN}" \
  --eval-every "${FLODL_EVAL_EVERY:-1}" \
  --reset-run
# --reset-run: compose reuses FLODL_RUN across `up`s and Redis keeps its volume, so the
# previous run's streams and secret are deleted before this run starts.

if [ -n "${FLODL_WORLD_SIZE:-}" ]; then
  set -- "$@" --world-size "$FLODL_WORLD_SIZE"
else
  set -- "$@" --min-workers "${FLODL_MIN_WORKERS:-1}" --join-timeout "${FLODL_JOIN_TIMEOUT:-20}"
fi
if [ -n "${FLODL_EPOCHS:-}" ]; then set -- "$@" --epochs "$FLODL_EPOCHS"; fi
if [ -n "${FLODL_SAVE_PATH:-}" ]; then set -- "$@" --save-path "$FLODL_SAVE_PATH"; fi
if [ -n "${FLODL_RESUME:-}" ]; then set -- "$@" --resume "$FLODL_RESUME"; fi
if [ -n "${FLODL_CONFIG:-}" ]; then set -- "$@" --config "$FLODL_CONFIG"; fi

# shellcheck disable=SC2086  # FLODL_COORDINATOR_ARGS is a list of flags
exec "$@" ${FLODL_COORDINATOR_ARGS:-}
