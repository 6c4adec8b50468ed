#!/usr/bin/env bash
# Tail a flodl_bus run's streams with nothing but redis-cli (no Python needed).
#
#   ops/tail.sh RUN [RANK]         REDIS_URL=redis://host:6379/0 (default: local)
#   TAIL_FROM_START=1 ops/tail.sh RUN    also print what is already there
#
# Prints one line per entry: stream, id, type, rank, seq (bodies are msgpack; use
# `flodl-bus tail` to decode them). Tracks the last id per stream and asks for entries
# strictly after it (XRANGE with an exclusive "(" start), so a burst is never skipped, as
# it would be with a `XREAD BLOCK ... $` loop. `redis-cli --csv` prints a read on one
# line with every byte of a binary body escaped, and awk cuts it into one line per entry:
# the observer needs no script (its ACL user may not run one: a busy script stops the
# server for everyone).
# TAIL_ROUNDS=N stops after N polling rounds (tests).
set -euo pipefail

run="${1:?usage: ops/tail.sh RUN [RANK]}"
rank="${2:-}"
url="${REDIS_URL:-redis://127.0.0.1:6379/0}"
rounds="${TAIL_ROUNDS:-0}"
cli=(redis-cli -u "$url" --no-auth-warning)
prefix="flodl:{${run}}:"

# One `--csv` XRANGE reply ("id","field","value",...,"id",...) -> "id field=value ..."
# per entry (body and mac left out, other values with blanks and escapes replaced by ?).
# Inside a value every quote is escaped, so `","` only ever separates two items; a new
# entry starts where a field name is expected and an id is found (names are words).
read -r -d '' entries <<'AWK' || true
{
  line = $0
  if (line == "" || line == "\"\"") next
  sub(/^"/, "", line); sub(/"$/, "", line)
  n = split(line, item, /","/)
  out = ""; i = 1
  while (i <= n) {
    if (item[i] ~ /^[0-9]+-[0-9]+$/) {
      if (out != "") print out
      out = item[i]; i++; continue
    }
    key = item[i]; value = (i < n) ? item[i + 1] : ""; i += 2
    if (key == "body" || key == "mac") continue
    gsub(/\\x[0-9a-f][0-9a-f]|\\.|[[:space:]]/, "?", value)
    out = out " " key "=" value
  }
  if (out != "") print out
}
AWK

declare -A last=()

discover() {
  local key
  if [[ -n "$rank" ]]; then
    for key in "${prefix}ctl:${rank}" "${prefix}ctl:all" "${prefix}up:${rank}" "${prefix}dlq"; do
      [[ "$("${cli[@]}" TYPE "$key")" == "stream" ]] && echo "$key"
    done
    return 0
  else
    for key in $("${cli[@]}" --scan --pattern "${prefix}*" | grep -E ':(ctl|up):[0-9a-z]+$|:dlq$'); do
      [[ "$("${cli[@]}" TYPE "$key")" == "stream" ]] && echo "$key"
    done
  fi
  return 0
}

first=1
n=0
while :; do
  for key in $(discover); do
    if [[ -z "${last[$key]:-}" ]]; then
      if [[ $first == 1 && -z "${TAIL_FROM_START:-}" ]]; then
        # start at the stream's current last entry
        top=$("${cli[@]}" XREVRANGE "$key" + - COUNT 1 | head -n 1)
        last[$key]="${top:-0-0}"
      else
        last[$key]="0-0"
      fi
    fi
  done
  first=0
  got=0
  for key in "${!last[@]}"; do
    while :; do
      mapfile -t lines < <("${cli[@]}" --csv XRANGE "$key" "(${last[$key]}" + COUNT 500 |
        awk "$entries")
      [[ ${#lines[@]} -eq 0 || -z "${lines[0]}" ]] && break
      for line in "${lines[@]}"; do
        printf '%s  %s\n' "${key#"$prefix"}" "$line"
      done
      last[$key]="${lines[-1]%% *}"
      got=1
      [[ ${#lines[@]} -lt 500 ]] && break
    done
  done
  n=$((n + 1))
  if [[ $rounds -gt 0 && $n -ge $rounds ]]; then
    break
  fi
  [[ $got == 0 ]] && sleep 0.2
done
