"""The host agent: one process per host that speaks to Redis for the ranks on it
(issue 31). Optional per run, off by default (see "Does it pay" below).

Why: each rank holds its own Redis connections, reads ``ctl:<r>`` + ``ctl:all`` itself,
and writes its own ``up:<r>``; the coordinator reads N upstream streams in one
XREADGROUP (1.5 ms at 1,024 ranks even when empty) and Redis serves N readers of
``ctl:all``. With K ranks a host, an agent makes that N/K of each.

What is read and written where
------------------------------
* Control (coordinator -> ranks): the agent reads ``ctl:<r>`` of each of its ranks and
  its shard's ``ctl:all`` in ONE XREAD (``GroupCursor``, ordered, no group: the same
  reader a rank uses, ``bus.reader._CursorReader``), and hands each entry, raw and in id
  order, to the ranks it is for over a Unix socket (``agent.frames``; a path on the
  host, never a network address). The agent verifies nothing and changes nothing: it
  holds no key. Each rank (``agent.rank_bus.AgentRankBus``) runs ``entries.parse`` with
  its own keys, exactly as when it reads Redis itself (MAC over stream, entry id, type,
  rank, seq, body; unicast with its rank key, broadcast with its slot or the
  coordinator's Ed25519 key).
* Upstream (ranks -> coordinator): a rank signs each message as a *folded item*
  (``bus.fold``): its rank key's MAC over its own ``up:<r>`` key, the entry-id slot set
  to ``b"fold"``, type, rank, its own seq and body. The agent puts every item its ranks
  sent since its last write into ONE entry of ``up:host:<name>`` (explicit id, MAXLEN ~,
  a lost reply checked with ``landed``), then acks each rank's frames. The coordinator
  (``RedisCoordinatorBus.add_fold``) reads that stream instead of the ranks' own ``up:<r>``,
  and ``bus.fold.unpack`` checks every item with the item's rank's key and that rank's
  last seq, delivering it as from ``up:<r>`` (synthetic id ``<ms>-<n*4096+k>``).
  What the MAC covers changes only for folded items (the id is replaced by ``fold``, the
  seq does its work); direct entries and every record made before are unchanged, and a
  folded item never verifies as a direct entry or the reverse. Replay sees folded items
  as entries of ``up:<r>`` and re-signs them as direct ones, so records replay as before.

How DESIGN §3 holds
-------------------
1. Order per rank: one atomic XREAD of a rank's two streams (with the other ranks'),
   released in id order; the agent forwards in that order on one socket; a rank that
   (re)connects says where it has read, and is handed everything the agent already
   released after that, merged by id, before anything new (the released entries are a
   prefix of the id order, so nothing later can overtake them).
2. Upstream order: a rank's items go in one socket in publish order, the agent writes
   its queue in order, items of one rank keep their seq order in and across entries.
3. No loss, no duplicate: the rank owns its cursor. After an agent restart it says hello
   with its positions, so a new agent (which reads the streams from their start) sends
   only what is after them; the rank also drops any id at or below the last it checked.
   Upstream frames stay with the rank until the agent acks them as written; after a
   reconnect they are sent again, and an item the first agent had written is refused by
   the coordinator as ``replayed`` (its seq is passed): applied once, never twice.
7/9. Bad input: every item is verified alone; a forged or altered one (by the agent, or
   one rank signing as another) is dead-lettered alone, the rest of its entry delivered.
   A whole entry that is not a well-formed fold (bad digest, not msgpack) is
   dead-lettered. A control entry a rank refuses goes to the dlq through the agent.
8. Authenticity: the agent cannot forge for a rank (no rank key) nor for the
   coordinator (no coordinator key); a rank cannot speak for another through the agent
   (its MAC is over its own ``up:<r>`` with its own key, and the coordinator accepts an
   item of rank r only from the fold stream of the host that serves r).
11. Heartbeats still say where each rank has read (``control_read``), so trimming and
   the coordinator's "owed" check work as before.

The death of the agent
----------------------
A rank whose agent socket closes reconnects for ``grace_s`` (``DEFAULT_AGENT_GRACE_S``,
5 s): an agent restarted by its supervisor in time costs nothing (see rule 3 above). If
it does not come back, the rank's reads raise ``bus.api.BusLost`` and its runtime takes
the escape hatch at once (``coordinator_lost``): the rank stops in order and exits with
``worker.rank.EXIT_COORDINATOR_LOST``. Its heartbeats stop, so the coordinator declares
it dead after its heartbeat timeout, exactly like a killed rank, and the run goes on or
stops as it would for dead ranks.

Using it
--------
Off unless asked for, and only through the API and the bench for now (``up``, the
worker and coordinator command lines do not start or use agents):

* agent: ``python -m flodl_bus.agent --url URL --run RUN --host h0 --ranks 0-7
  --socket /run/flodl/h0.sock`` (prints one ``ready`` line on stdout; its Redis user
  is ``agent.acl.agent_rules``);
* each rank: ``AgentRankBus(socket, RunKeys(run), rank, rank_keys)`` instead of
  ``RedisRankBus`` (the runtime is unchanged);
* coordinator: ``RedisCoordinatorBus.add_fold("h0", range(8))`` before ``add_rank``
  of those ranks.

Does it pay
-----------
Not on what a user sees, at the sizes this host can simulate; so it stays off.
``flodl-bus bench scale --ranks 64 --ranks-per-host 1,8 --rounds 2`` (2 shared cores,
loaded; K=1 first, K=8 second, interleaved):

* coordinator CPU 0.35 / 0.37 cores -> 0.25 / 0.24 (-32%); redis-server CPU
  0.22 / 0.24 -> 0.06 / 0.06 (-73%); the ranks' processes 0.66 / 0.70 -> 0.38 / 0.35;
  the 8 agents add 0.40 / 0.37: the host's total falls ~15%;
* epoch overhead vs ideal +9.1% / +6.4% -> +5.4% / +8.9%, dispatch p50 20.6 / 20.1 ms
  -> 20.4 / 13.6 ms, p99 110 / 79 -> 145 / 91 ms: within the noise of a saturated
  host, and no better.

With the agent lingering like a rank's publisher (an entry then holds 2.4-2.9
messages instead of 1.5), two more interleaved rounds at 64 ranks: coordinator CPU 0.25 /
0.33 -> 0.28 / 0.24, Redis 0.15 / 0.18 -> 0.06 / 0.05, ranks 0.56 / 0.57 -> 0.45 / 0.39,
agents +0.45 / 0.41; epoch overhead +12.4% / +10.0% -> +8.8% / +6.2%, dispatch p50
21.6 / 21.0 -> 32.1 / 20.7 ms, p99 158 / 136 -> 111 / 89 ms. Redis always gains;
the coordinator's CPU moves by less than the noise.

At 128 ranks (one round) the same shift: coordinator 0.25 -> 0.18 cores, Redis 0.15 ->
0.05, ranks 1.09 -> 0.68, agents +0.56 (total 1.49 -> 1.47 cores); epoch +104% ->
+99%, dispatch p50 120 -> 119 ms (the harness saturates the host either way). The
agent moves work off the two shared single-threaded parts (coordinator, Redis) onto
the hosts; it should pay where the coordinator's ingest saturates (1,024 ranks), which
this host cannot simulate end to end. What it does to the coordinator's own path there,
``flodl-bus bench agent --ranks 64,256,1024`` (K=8, two runs, best of 3 each):

* ingest per message, direct -> folded: 64 ranks 13.8 -> 14.2 / 40.4 -> 33.0 us;
  256: 41.7 -> 31.0 / 36.7 -> 26.9 us; 1,024: 64.0 -> 45.4 / 59.6 -> 32.3 us
  (0.54-0.71x; the budget at 1,024 ranks and 50 ms steps is 24.4 us);
* an XREADGROUP that finds nothing: 1,024 ranks 1,186 -> 165 / 2,169 -> 298 us (0.14x).

Its folded entries hold a whole step of 8 ranks there: the best case. With 2 messages
an entry (``--fold-items 2``, what live agents fold at 64 ranks) ingest per message is
no better: 1,024 ranks 20.1 -> 26.6 us and 31.9 -> 34.0 us (1.06-1.32x; each item
still costs its MAC and decode, and the unpacking adds), while the empty read keeps its
0.14-0.33x. Measure a real 1,024-rank run before turning it on by default.

Reader processes (``--ingest-procs``) read fold streams too: the reader that owns one
unpacks it and checks each item with its rank's key and seq, so agents and readers
combine (``bench scale --ranks-per-host 8 --ingest-procs 4``); on two cores the
dispatching thread is then left 1.6-1.7 us a folded message (BENCHMARKS.md).
"""
