"""The Redis state backend: counters and the key/user store shared by every gateway replica.

Hot path: one ``EVALSHA`` per limited request (``ADMIT``: read every window, charge them only if
all pass, atomically). Tokens and the concurrency slot are settled after the answer by another
script, off the client's path. Nothing is ever awaited without a bound: every call has the
socket timeouts of ``state.timeout_s`` and no client-side retries.

Availability: the first failed call marks the backend *down*; while down, the hot path does not
touch Redis at all (the caller applies ``state.failure_policy`` at once), and only the periodic
sync probes it, with exponential backoff. The first successful sync marks it *up* again. A Redis
that answers but refuses writes (out of memory, a replica, a failed RDB save, too few replicas of
its own) is *refusing*: the
hot path still asks it (a read-only check, a user already at a limit, is answered as before) and
meets the refusal as an unreachable state, and the first sync whose heartbeat write lands ends it.
A Redis that refuses the gateway's commands (its ACL user lacks a permission: NOPERM; a key of the
gateway's names holds another type: WRONGTYPE) is refusing too, until a heartbeat lands with no
such refusal met for ``REFUSAL_HOLD_S``. Either way the backend is *healthy* only when it is up and
not refusing.

Keys (``P`` = ``state.key_prefix``), all with an expiry except the directory:
``P:rpm:<user>``, ``P:tpm:<user>``, ``P:rps:<model>`` windows (PEXPIRE at first hit);
``P:conc:<user>`` hash replica id → requests in flight (entries of replicas that stopped
heartbeating are dropped by the next check); ``P:slotusers:<replica>`` set of the users whose hash
has an entry of that replica's (a run started again under a configured replica id takes its
last run's entries out at its first heartbeat); ``P:replicas`` zset replica id → last heartbeat
(Redis server time, so replica clocks do not matter); ``P:inflight:<replica>`` hash endpoint →
in-flight (TTL ``replica_ttl_s``); ``P:users``, ``P:keys`` (SHA-256 digest → record) and
``P:version`` (bumped on every directory write) and ``P:dirlog`` (the change log: a zset of the
fields each version changed, scored by version, trimmed to the last ``LOG_VERSIONS``), so a replica
whose mirror is a few versions behind reads only what changed since, not the whole directory;
``P:keyindex`` (the keys by user, for a user's delete) and ``P:keyindex:at`` (the version it is
current at); ``P:dirnotes`` (a stream of the versions written, its last hundred or so: every process
of every replica blocks reading it, ``gateway.tenants.notices``, and brings its mirror up to date as
soon as a change is written); ``P:admintokens`` hash replica id → the SHA-256 of its admin token
(each heartbeat writes it and drops those of replicas without a heartbeat younger than
``replica_ttl_s``; a reload's at once),
which ``POST /admin/keys`` refuses as a key.

On a Redis Cluster every one of these keys carries the hash tag ``{P}`` (``{P}:rpm:<user>``...),
so that a script's keys — and the per-replica keys the sync script computes — share one slot;
elsewhere the names are as above. See gateway/state/redis.py for the client and its failover.

Failover (Sentinel, Cluster): replication is asynchronous, so a primary that dies may take with
it the updates it acknowledged last. What this module does about the rest: requests served
while the state was unreachable (``failure_policy: open``) and tokens it could not charge are
tallied here and added to the shared windows once the state is back (``_reconcile``); every
concurrency slot this replica holds is re-published then (``_repair``); directory writes wait
for a replica's acknowledgement (``WAIT``) before the admin API answers. A standalone Redis keeps
its old behaviour: its outage is usually a restart that lost the windows, which start afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from gateway.config.schema import StateConfig, UserLimits
from gateway.state.redis import (
    COMMAND_REFUSALS,
    UNAVAILABLE,
    PoolTimeout,
    close_client,
    forget_topology,
    held_loop_timeout,
    no_tls_answer,
    redis_client,
    refusal,
    shared_prefix,
    state_mode,
    transport_reason,
)
from gateway.tenants.directory import KeyRecord, limits_from_stored, limits_stored
from gateway.tenants.limits import MODEL_WINDOW_MS, USER_WINDOW_MS, AdmitQuery, AdmitResult

log = structlog.get_logger("switchyard.tenancy")

# The requests in flight a user's concurrency hash (replica id -> count) holds on replicas still
# heartbeating (their entry in the replicas zset younger than the ttl); ``drop``: forget the others.
_LIVE_SLOTS = """
local function live_slots(hash, replicas, me, ttl_ms, drop)
  local t = redis.call('TIME')
  local oldest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - ttl_ms
  local n = 0
  local h = redis.call('HGETALL', hash)
  for i = 1, #h, 2 do
    local alive = h[i] == me
    if not alive then
      local s = redis.call('ZSCORE', replicas, h[i])
      alive = s and tonumber(s) >= oldest
    end
    if alive then n = n + tonumber(h[i + 1]) elseif drop then redis.call('HDEL', hash, h[i]) end
  end
  return n
end
"""

# how long a replica's list of the users it holds slots of is kept after its last slot (as a
# user's concurrency hash is after their last check)
SLOT_USERS_TTL_MS = 86_400_000

ADMIT = _LIVE_SLOTS + """
-- KEYS: 1 rpm window, 2 tpm window, 3 concurrency hash, 4 model rps window, 5 replicas zset,
--       6 the users this replica holds slots of
-- ARGV: 1 rpm, 2 tpm, 3 max_concurrent, 4 rps, 5 replica id, 6 replica ttl ms, 7 user window ms,
--       8 model window ms, 9 user
local rpm, tpm, conc, rps = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local win, mwin = tonumber(ARGV[7]), tonumber(ARGV[8])

local function window(key, limit, w)
  if limit <= 0 then return 0, 0 end
  local n = tonumber(redis.call('GET', key) or '0')
  if n == 0 then return 0, 0 end
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then redis.call('PEXPIRE', key, w); ttl = w end
  return n, ttl
end

local function bump(key, w)
  local n = redis.call('INCR', key)
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then redis.call('PEXPIRE', key, w); ttl = w end
  return n, ttl
end

local rn, rt = window(KEYS[1], rpm, win)
local tn, tt = window(KEYS[2], tpm, win)
local mn, mt = window(KEYS[4], rps, mwin)
local cn = 0
if conc > 0 then cn = live_slots(KEYS[3], KEYS[5], ARGV[5], tonumber(ARGV[6]), true) end
local reason = ''
if rps > 0 and mn >= rps then reason = 'model_rps'
elseif rpm > 0 and rn >= rpm then reason = 'rpm'
elseif tpm > 0 and tn >= tpm then reason = 'tpm'
elseif conc > 0 and cn >= conc then reason = 'concurrency' end
local acquired = 0
if reason == '' then
  if rpm > 0 then rn, rt = bump(KEYS[1], win) end
  if rps > 0 then mn, mt = bump(KEYS[4], mwin) end
  if conc > 0 then
    redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
    redis.call('PEXPIRE', KEYS[3], 86400000)
    redis.call('SADD', KEYS[6], ARGV[9])
    redis.call('PEXPIRE', KEYS[6], 86400000)
    cn = cn + 1
    acquired = 1
  end
end
return {reason, rn, rt, tn, tt, cn, mn, mt, acquired}
"""

SETTLE = """
-- KEYS: 1 tpm window, 2 concurrency hash; ARGV: 1 tokens, 2 window ms, 3 replica id, 4 release (1/0)
local tokens = tonumber(ARGV[1])
if tokens > 0 then
  redis.call('INCRBY', KEYS[1], tokens)
  if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
end
if ARGV[4] == '1' then
  if redis.call('HINCRBY', KEYS[2], ARGV[3], -1) <= 0 then redis.call('HDEL', KEYS[2], ARGV[3]) end
end
return 1
"""

UNCOUNT = """
-- KEYS: windows to give one count back to (the user's RPM, the model's RPS), while they last
for i = 1, #KEYS do
  if tonumber(redis.call('GET', KEYS[i]) or '0') > 0 then redis.call('DECR', KEYS[i]) end
end
return 1
"""

SYNC = """
-- KEYS: 1 replicas zset, 2 this replica's in-flight hash, 3 directory version, 4 admin tokens hash
-- ARGV: 1 replica id, 2 replica ttl ms, 3 in-flight key prefix, 4 share (1/0), 5 the SHA-256 of this
--       replica's admin token ('' without one), 6.. endpoint, count pairs
-- Returns {version, lost, endpoint, others' sum, ...}; lost is 1 when this replica's heartbeat was
-- not there, or too old to count (Redis lost its data, or the replica was silent past the ttl and
-- the others may have dropped its concurrency slots), else 0
local rid, ttl = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = redis.call('ZSCORE', KEYS[1], rid)
local lost = 0
if not last or tonumber(last) < now - ttl then lost = 1 end
redis.call('ZADD', KEYS[1], now, rid)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
for _, r in ipairs(redis.call('HKEYS', KEYS[4])) do
  if not redis.call('ZSCORE', KEYS[1], r) then redis.call('HDEL', KEYS[4], r) end
end
redis.call('PEXPIRE', KEYS[1], 86400000)
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[4], rid, ARGV[5])
  redis.call('PEXPIRE', KEYS[4], 86400000)
else
  redis.call('HDEL', KEYS[4], rid)
end
local out = {redis.call('GET', KEYS[3]) or '0', lost}
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[2])
  if #ARGV > 5 then
    redis.call('HSET', KEYS[2], unpack(ARGV, 6))
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
  local sums = {}
  for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    if r ~= rid then
      local h = redis.call('HGETALL', ARGV[3] .. r)
      for i = 1, #h, 2 do sums[h[i]] = (sums[h[i]] or 0) + tonumber(h[i + 1]) end
    end
  end
  for k, v in pairs(sums) do out[#out + 1] = k; out[#out + 1] = tostring(v) end
end
return out
"""

USAGE = _LIVE_SLOTS + """
-- KEYS: 1 rpm window, 2 tpm window, 3 concurrency hash, 4 replicas zset; ARGV: 1 replica id, 2 replica ttl ms
-- The user's windows and requests in flight, counting (as ADMIT does) only replicas still heartbeating.
local cn = live_slots(KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), false)
return {redis.call('GET', KEYS[1]) or '0', redis.call('PTTL', KEYS[1]),
        redis.call('GET', KEYS[2]) or '0', redis.call('PTTL', KEYS[2]), cn}
"""

RECONCILE = """
-- KEYS: 1 this batch's marker, then windows; ARGV: 1 the marker's life in ms, then for each window
-- the count to add and the window's rest in ms (if it has no expiry). A batch sent again (its
-- answer was lost) finds its marker and adds nothing twice.
if not redis.call('SET', KEYS[1], 1, 'NX', 'PX', ARGV[1]) then return 0 end
for i = 2, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[2 * i - 2])
  if redis.call('PTTL', KEYS[i]) < 0 then redis.call('PEXPIRE', KEYS[i], ARGV[2 * i - 1]) end
end
return #KEYS - 1
"""

DIRECTORY = """
-- KEYS: 1 users hash, 2 keys hash, 3 directory version, 4 change log, 5 the keys' index by user
-- (a zset of '<user> <digest>', every score 0, read by lexical range), 6 the directory version the
-- index was last made current at, 7 the change notices (a stream every replica reads)
-- ARGV: 1 this write's tag (random), 2 the versions the log keeps, then quadruples
-- (op, hash 1|2, field, value): op S sets the field, D deletes it, N sets it only
-- if it is absent (a create), X only if it is present (a change), R deletes it only if it is
-- present; P merges value, {"set": {name: integer}, "base": record or absent}, into the field's
-- record, the base standing for a record that is absent (a configured user), and only if one of the
-- two is there; K deletes every record of the keys hash whose user is the field (found in the index,
-- not by a read of every key: a user's delete costs the user's keys, not the directory's). When a condition
-- fails nothing is written and the answer is -1, else {version, records K deleted}. Every read a
-- change depends on is made here, in the step that writes it: two creates cannot both succeed, a
-- change cannot bring back what a delete just removed, two changes of one record both land, and a
-- user's delete takes every key the user has when it runs, one made a moment ago elsewhere included.
-- The new version goes in the change log with every field it wrote or deleted, as members
-- '<version>:<tag>:<hash>:<field>' (and '<version>:<tag>:0:', so that no version is missing from it),
-- and versions older than the log keeps are dropped from it. The new version is also added to the
-- change notices, whose short tail is all Redis keeps: a replica reading them takes the change in
-- at once (what changed, it reads from the log).
-- The index is kept by every write of this script; a directory written by anything else since the
-- index's version (a replica of an older release, a restore) has it made again from the keys hash
-- first, once, so that a user's delete never misses a key.
local function owner(value)
  local ok, rec = pcall(cjson.decode, value)
  if ok and type(rec) == 'table' and type(rec.user) == 'string' then return rec.user end
  return ''
end
local function index_current()
  if redis.call('GET', KEYS[6]) == (redis.call('GET', KEYS[3]) or '0') then return end
  redis.call('DEL', KEYS[5])
  local h = redis.call('HGETALL', KEYS[2])
  local members = {}
  for i = 1, #h, 2 do
    members[#members + 1] = 0
    members[#members + 1] = owner(h[i + 1]) .. ' ' .. h[i]
    if #members >= 1000 then redis.call('ZADD', KEYS[5], unpack(members)); members = {} end
  end
  if #members > 0 then redis.call('ZADD', KEYS[5], unpack(members)) end
end
local function unindex(field)
  local old = redis.call('HGET', KEYS[2], field)
  if old then redis.call('ZREM', KEYS[5], owner(old) .. ' ' .. field) end
end
local function merged(key, field, value)
  local patch = cjson.decode(value)
  local cur = redis.call('HGET', key, field)
  local rec
  if cur then rec = cjson.decode(cur) elseif type(patch.base) == 'table' then rec = patch.base else return nil end
  for k, v in pairs(patch.set) do
    if v == cjson.null then rec[k] = nil else rec[k] = v end
  end
  local names, parts = {}, {}
  for k in pairs(rec) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local v = rec[k]
    if type(v) == 'number' then parts[#parts + 1] = string.format('"%s":%d', k, v)
    else parts[#parts + 1] = string.format('"%s":%s', k, cjson.encode(v)) end
  end
  return '{' .. table.concat(parts, ',') .. '}'
end

local writes = {}
for i = 3, #ARGV, 4 do
  local op, key, field, value = ARGV[i], KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2], ARGV[i + 3]
  if op == 'N' or op == 'X' or op == 'R' then
    if (redis.call('HEXISTS', key, field) == 1) == (op == 'N') then return -1 end
  elseif op == 'P' then
    value = merged(key, field, value)
    if not value then return -1 end
  end
  writes[#writes + 1] = {op, key, field, value, ARGV[i + 1]}
end
index_current()
local removed = 0
local changed = {}
for _, w in ipairs(writes) do
  local op, key, field, value = w[1], w[2], w[3], w[4]
  if op == 'K' then
    for _, m in ipairs(redis.call('ZRANGEBYLEX', KEYS[5], '[' .. field .. ' ', '(' .. field .. '!')) do
      local digest = string.sub(m, #field + 2)
      if not string.find(digest, ' ', 1, true) then    -- not a record of a user 'field <more>'
        redis.call('ZREM', KEYS[5], m)
        if redis.call('HDEL', KEYS[2], digest) == 1 then
          removed = removed + 1
          changed[#changed + 1] = '2:' .. digest
        end
      end
    end
  else
    if key == KEYS[2] then unindex(field) end
    if op == 'D' or op == 'R' then
      redis.call('HDEL', key, field)
    else
      redis.call('HSET', key, field, value)
      if key == KEYS[2] then redis.call('ZADD', KEYS[5], 0, owner(value) .. ' ' .. field) end
    end
    changed[#changed + 1] = w[5] .. ':' .. field
  end
end
local version = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[6], version)
local head = version .. ':' .. ARGV[1] .. ':'
local members = {version, head .. '0:'}
for _, c in ipairs(changed) do
  members[#members + 1] = version
  members[#members + 1] = head .. c
  if #members >= 1000 then redis.call('ZADD', KEYS[4], unpack(members)); members = {} end
end
if #members > 0 then redis.call('ZADD', KEYS[4], unpack(members)) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', version - tonumber(ARGV[2]))
redis.call('XADD', KEYS[7], 'MAXLEN', '~', 100, '*', 'v', version)
return {version, removed}
"""

CHANGES = """
-- KEYS: 1 users hash, 2 keys hash, 3 directory version, 4 change log
-- ARGV: 1 the version the caller's mirror has, 2 the most log entries it takes
-- Returns {version} when the caller is not behind, {version, 'far'} when more changed since its
-- version than it takes, else {version, entry, value, ...}: every log entry scored from the
-- caller's version up (its own version's too, so that it can tell the store's history is the one
-- it read), each with its field's value now (nil: deleted, or the caller's own version's entry).
-- Whether the log holds every version since the caller's is for the caller to see.
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
local since = tonumber(ARGV[1])
local out = {tostring(version)}
if version <= since then return out end
if redis.call('ZCOUNT', KEYS[4], since, version) > tonumber(ARGV[2]) then
  out[2] = 'far'
  return out
end
for _, entry in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], since, version)) do
  local v, h, field = string.match(entry, '^(%d+):[^:]*:(%d):(.*)$')
  local value = false
  if v and h ~= '0' and tonumber(v) > since then value = redis.call('HGET', KEYS[tonumber(h)], field) or false end
  out[#out + 1] = entry
  out[#out + 1] = value
end
return out
"""

WHOLE_DIRECTORY = """
-- KEYS: 1 directory version, 2 users hash, 3 keys hash, 4 change log
-- Returns {version (false: none yet), users hash, keys hash, the log's newest entry (or none)}, read
-- in one step. A script, not a transaction: the Cluster client runs each command of a transaction
-- in a thread with an event loop of its own, which can wait for a lock the caller's loop holds.
return {redis.call('GET', KEYS[1]) or false, redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
        redis.call('ZREVRANGE', KEYS[4], 0, 0)}
"""

# the versions the directory's change log keeps, and the most entries a replica reads from it: a
# mirror further behind (after an outage, or a user's delete of thousands of keys) is read whole
LOG_VERSIONS = 1000
MAX_CHANGES = 2000

# the warning that tokens went uncharged (a standalone Redis down or refusing writes) comes at
# most this often, with the tally since the last one
UNCHARGED_LOG_EVERY_S = 10.0

# transport failures (and a failover in progress) mark the backend down; anything else is a bug
# in a call, not an outage
_TRANSPORT = UNAVAILABLE

# a refusal of the gateway's commands (noperm, wrongtype) ends when a heartbeat lands and no call
# met one for this long: the heartbeat may touch none of the keys (or commands) refused
REFUSAL_HOLD_S = 10.0


class StateUnavailable(Exception):
    """The shared state could not be reached (or is marked down); the caller applies the policy.
    ``reason``: ``unreachable`` (``no_tls``: a TLS URL's server took the connection and never
    answered the handshake, as a Redis serving plain TCP does), or what a Redis that answered said: ``oom``, ``readonly``,
    ``misconf``, ``noreplicas`` (it refuses writes), ``noperm``, ``wrongtype`` (it refuses the
    command: see gateway/state/redis.py ``refusal``), ``auth`` (it refuses the connection's
    password or user), ``error`` (another error), ``busy`` (every
    connection of ``state.max_connections`` in use past ``state.timeout_s``: the call was not
    sent)."""

    def __init__(self, message: str = "", reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason


# what the operator's log lines say the shared state did, by ``StateUnavailable.reason``: a Redis
# that answers with a refusal is not "unreachable", which would send them looking at the network
TROUBLE = {
    "unreachable": "shared state unreachable",
    "no_tls": "shared state unreachable: no TLS handshake answer (is this Redis serving TLS? use redis:// for plain TCP)",
    "oom": "shared state refuses writes (out of memory)",
    "readonly": "shared state refuses writes (a read-only replica)",
    "misconf": "shared state refuses writes (its RDB save failed)",
    "noreplicas": "shared state refuses writes (fewer replicas than min-replicas-to-write)",
    "noperm": "shared state refuses the gateway's commands (its ACL user lacks a permission)",
    "wrongtype": "shared state refuses the gateway's commands (a key of the gateway's holds another type)",
    "auth": "shared state refuses the gateway's credentials (a wrong password or user, or none)",
    "busy": "shared state connections all busy",
    "error": "shared state answers an error",
}


def trouble(reason: str | None) -> str:
    """The words for what the shared state did (``reason``: a ``StateUnavailable``'s)."""
    return TROUBLE.get(reason or "unreachable", f"shared state fails ({reason})")


def _answered(e: BaseException) -> StateUnavailable:
    """A Redis error answered to a call, as the caller sees it."""
    return StateUnavailable(f"{type(e).__name__}: {e}", refusal(e) or "error")


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class RedisState:
    remote = True

    def __init__(self, cfg: StateConfig, replica_id: str | None = None,
                 on_transition: Callable[[bool, str, str], None] | None = None,
                 on_pool_timeout: Callable[[], None] | None = None,
                 on_uncharged: Callable[[int], None] | None = None,
                 on_heartbeat_lost: Callable[[], None] | None = None) -> None:
        assert cfg.redis_url is not None
        self.cfg = cfg
        self.replica_id = replica_id or cfg.replica_id or default_replica_id()
        self.timeout = cfg.timeout_s
        self.mode = state_mode(cfg)
        # after a failover the promoted replica has what was replicated: add what was served
        # meanwhile (standalone: as before, an outage's requests are not added afterwards)
        self.reconcile = self.mode != "standalone"
        self.client = redis_client(cfg, on_pool_timeout=on_pool_timeout)
        self._sha = {src: hashlib.sha1(src.encode()).hexdigest()
                     for src in (ADMIT, SETTLE, RECONCILE, UNCOUNT, USAGE, CHANGES, WHOLE_DIRECTORY)}
        self._sync = self.client.register_script(SYNC)
        self._ttl_ms = int(cfg.replica_ttl_s * 1000)
        p = shared_prefix(cfg)
        self.k_replicas = f"{p}:replicas"
        self.k_inflight_prefix = f"{p}:inflight:"
        self.k_users, self.k_keys, self.k_version = f"{p}:users", f"{p}:keys", f"{p}:version"
        self.k_log = f"{p}:dirlog"
        self.k_key_index, self.k_key_index_at = f"{p}:keyindex", f"{p}:keyindex:at"
        self.k_notes = f"{p}:dirnotes"
        self.k_admin_tokens = f"{p}:admintokens"
        # the SHA-256 of this replica's admin token ('' without one), published with each heartbeat
        self.admin_digest = ""
        self._p = p
        self.up = False
        self.refused = ""                           # why Redis refuses writes (oom, readonly, ...)
        self._down_reason = "unreachable"           # why it is down: unreachable, no_tls, or auth
        self._refused_at = 0.0                      # ... or commands (noperm, wrongtype): when last
        self._healthy = False                       # what on_transition last said
        self.last_ok = 0.0                          # monotonic time of the last successful call
        self._on_transition = on_transition or (lambda healthy, why, reason: None)
        self._on_uncharged = on_uncharged or (lambda tokens: None)
        self._on_heartbeat_lost = on_heartbeat_lost or (lambda: None)
        # tokens no window was charged since the last warning that said so, and that warning's time
        self._uncharged: list[int] = [0, 0]         # tokens, requests
        self._uncharged_logged = -UNCHARGED_LOG_EVERY_S
        self._tasks: set[asyncio.Task] = set()
        self._queue: list[tuple] = []               # scripts waiting for this loop turn's pipeline
        self._flush_scheduled = False
        self.held: dict[str, int] = {}               # concurrency slots this replica holds, by user
        self._dirty: set[str] = set()                # users whose slot count must be re-published
        self._slot_users: set[str] = set()           # users this replica ever held a slot for
        self._beating = False                        # a heartbeat of this replica's has landed
        # counts the shared windows missed while unreachable: window key -> [count, monotonic start]
        self._tally: dict[str, list] = {}
        # tallies handed to a reconcile whose answer did not come: sent again as they were, under
        # their marker, until one answer comes (so a batch Redis ran but whose answer was lost is
        # not added twice): [(marker key, {window key: [count, start]})]
        self._unsent: list[tuple[str, dict[str, list]]] = []
        self._batch = 0
        self._nonce = secrets.token_hex(4)          # markers of a restarted replica are new ones

    # -- availability ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Reachable and taking writes: what ``switchyard_state_up`` says."""
        return self.up and not self.refused

    @property
    def down_reason(self) -> str | None:
        """Why the state is not healthy (``unreachable`` or ``auth``, or a refusal: ``oom``,
        ``readonly``, ``misconf``, ``noreplicas``, ``noperm``, ``wrongtype``), or None."""
        return self.refused or (None if self.up else self._down_reason)

    def _mark(self, up: bool, why: str = "", reason: str = "unreachable") -> None:
        if up:
            self.last_ok = time.monotonic()
        else:
            self.refused = ""                   # what it last answered is no news of it now
            self._down_reason = reason
        if up != self.up:
            self.up = up
            if up:
                # the state may have lost this replica's slot updates (a failover, a restart):
                # re-publish the exact count of every user it has held slots for
                self._dirty |= self._slot_users
        self._tell(why)

    def _refusing(self, reason: str, why: str) -> None:
        """Redis answered a call with a refusal: unhealthy until a sync's heartbeat lands (after a
        refusal of a command, once none came for ``REFUSAL_HOLD_S``)."""
        if reason in COMMAND_REFUSALS:
            self._refused_at = time.monotonic()
        if reason != self.refused:
            self.refused = reason
            self._tell(why)

    def _tell(self, why: str = "") -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            self._on_transition(healthy, why, self.down_reason or "")

    async def _call(self, coro, probe: bool = False):
        """Await one Redis call; a transport failure marks the backend down."""
        if not self.up and not probe:
            coro.close()
            raise StateUnavailable("redis is marked down", self.down_reason or "unreachable")
        try:
            # belt and braces: the socket timeouts bound each read, this bounds the whole call
            async with held_loop_timeout(self.timeout * 4):
                out = await coro
        except PoolTimeout as e:
            # every connection busy (a burst, a slow Redis): this call was not sent, and says
            # nothing of Redis itself, so the state is not marked down; the caller degrades as
            # for an unreachable Redis (the calls holding the connections find out if it is)
            raise StateUnavailable(str(e), "busy") from None
        except _TRANSPORT as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # the client library can turn a cancellation that raced an I/O error into that
                # error: never let it swallow the cancel (a stop would wait for ever)
                raise asyncio.CancelledError from None
            # a refused password is out of reach as well (no connection is made), but is said to be one
            reason = "no_tls" if no_tls_answer(e) else transport_reason(e)
            self._mark(False, f"{type(e).__name__}: {e}", reason)
            await forget_topology(self.client)
            raise StateUnavailable(str(e) or type(e).__name__, reason) from None
        except RedisError as e:
            err = _answered(e)
            if err.reason != "error":
                self._refusing(err.reason, str(err))
            raise err from None
        self._mark(True)
        return out

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self._flush()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout * 4)
        for t in list(self._tasks):
            t.cancel()
        await close_client(self.client)

    # -- auto-pipelining ---------------------------------------------------------------------
    # Scripts called in the same event-loop turn (a burst of admits, the settles of finished
    # requests) go out as one pipeline: one write, one read, one pooled connection. Alone, a call
    # costs one loop turn more than a direct call; under load it is what keeps the Redis client's
    # per-call CPU from dominating the gateway's.

    def _submit(self, script: str, keys: list[str], args: list, orphan: Callable | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((script, keys, args, fut, orphan))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._queue = self._queue, []
        if batch:
            t = asyncio.ensure_future(self._send(batch))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipeline(self, batch: list) -> list:
        results = await self._evalsha_all([(b[0], b[1], b[2]) for b in batch])
        _raise_unavailable(results)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:     # Redis restarted or flushed its scripts: load them and send those again
            for src in self._sha:
                await self.client.script_load(src)
            again = await self._evalsha_all([(batch[i][0], batch[i][1], batch[i][2]) for i in missing])
            _raise_unavailable(again)
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        return results

    async def _evalsha_all(self, calls: list[tuple[str, list[str], list]]) -> list:
        if len(calls) == 1:             # alone: a plain command is cheaper than a pipeline of one
            script, keys, args = calls[0]
            try:
                return [await self.client.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)]
            except ResponseError as e:
                return [e]
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    async def _send(self, batch: list) -> None:
        try:
            results = await self._call(self._pipeline(batch), probe=True)
        except StateUnavailable as e:
            for *_, fut, _orphan in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        except asyncio.CancelledError:
            for *_, fut, _orphan in batch:
                fut.cancel()
            raise
        except Exception as e:        # a bug must not leave requests waiting for ever
            log.exception("redis pipeline failed")
            for *_, fut, _orphan in batch:
                if not fut.done():
                    fut.set_exception(StateUnavailable(f"{type(e).__name__}: {e}"))
            return
        for (_s, _k, _a, fut, orphan), r in zip(batch, results, strict=True):
            if fut.done():                  # its request went away while we waited
                if orphan is not None and not isinstance(r, Exception):
                    orphan(r)
            elif isinstance(r, Exception):
                err = _answered(r)
                if err.reason != "error":
                    self._refusing(err.reason, str(err))
                fut.set_exception(err)
            else:
                fut.set_result(r)

    # -- counters ----------------------------------------------------------------------------

    def _user_keys(self, user: str) -> tuple[str, str, str]:
        p = self._p
        return f"{p}:rpm:{user}", f"{p}:tpm:{user}", f"{p}:conc:{user}"

    def _k_slot_users(self) -> str:
        """The users whose concurrency hash holds an entry of this replica's (``replica_id`` is
        set per worker after construction, so the name is made when used)."""
        return f"{self._p}:slotusers:{self.replica_id}"

    async def admit(self, q: AdmitQuery) -> AdmitResult:
        if not self.up:
            raise StateUnavailable("redis is marked down", self.down_reason or "unreachable")
        lim = q.limits
        user = q.user or ""
        k_rpm, k_tpm, k_conc = self._user_keys(user)
        args = [lim.rpm if lim else 0, lim.tpm if lim else 0, lim.max_concurrent if lim else 0, q.model_rps,
                self.replica_id, self._ttl_ms, USER_WINDOW_MS, MODEL_WINDOW_MS, user]
        fut = self._submit(ADMIT, [k_rpm, k_tpm, k_conc, f"{self._p}:rps:{q.model}", self.k_replicas,
                                   self._k_slot_users()], args, orphan=functools.partial(self._orphan_admit, q))
        try:
            out = await fut
        except asyncio.CancelledError:
            # cancelled after the answer came in but before this woke for it: the pipeline saw a
            # future still waiting and gave it the answer, so the orphan's part is done here
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._orphan_admit(q, fut.result())
            raise
        except StateUnavailable as e:
            if e.reason == "unreachable" and lim is not None and lim.max_concurrent:
                # the check may still run in Redis with nobody to read its answer (a Redis stopped
                # or too slow for timeout_s reads it later): the next good sync publishes this
                # user's exact count, so a slot it took there for nobody is given back. (A check
                # Redis answered with an error, or one never sent for want of a connection, took
                # nothing.)
                self._slot_users.add(user)
                self._dirty.add(user)
            raise
        reason = out[0].decode() if out[0] else None
        r = AdmitResult(reason=reason, requests=int(out[1]), requests_reset_ms=int(out[2]), tokens=int(out[3]),
                        tokens_reset_ms=int(out[4]), concurrent=int(out[5]), model_requests=int(out[6]),
                        model_reset_ms=int(out[7]), acquired=bool(out[8]))
        if r.acquired:
            self.held[user] = self.held.get(user, 0) + 1
            self._slot_users.add(user)
        return r

    @property
    def unreconciled(self) -> int:
        """Windows whose outage counts are still to be added to the shared state."""
        return len(self._tally) + sum(len(b) for _, b in self._unsent)

    def served_unchecked(self, q: AdmitQuery) -> None:
        """A request served without a check (``failure_policy: open``, state unreachable): count
        it against the user's RPM window locally, to be added to the shared one once it is back."""
        if self.reconcile and q.limits is not None and q.limits.rpm:
            self._count_locally(self._user_keys(q.user or "")[0], 1)

    def _count_locally(self, key: str, n: int) -> None:
        now = time.monotonic()
        entry = self._tally.get(key)
        if entry is None or now - entry[1] >= USER_WINDOW_MS / 1000:
            self._tally[key] = [n, now]         # a window of its own, as the shared one would be
        else:
            entry[0] += n

    def _orphan_admit(self, q: AdmitQuery, out: list) -> None:
        """The request left while its check was in flight: no engine saw it, so it gives back the
        slot it may have taken and, if it passed, its counts in the request windows (those that
        will not end before the call could reach them)."""
        user = q.user or ""
        if out[8]:
            self._settle(user, 0, True)
        if out[0]:                          # refused: it counted nothing
            return
        keys = []
        if q.limits is not None and q.limits.rpm and int(out[2]) > 50:
            keys.append(self._user_keys(user)[0])
        if q.model_rps and int(out[7]) > 50:
            keys.append(f"{self._p}:rps:{q.model}")
        if keys and self.up:
            self._submit(UNCOUNT, keys, []).add_done_callback(_retrieved)

    def uncount(self, user: str, counted: tuple[float | None, float | None, str]) -> None:
        """A request no engine saw gives its count back to the shared windows it was counted in,
        while they last (in the background). Not while the state is down: a count made then is
        reconciled later, and one that is lost costs the user one request of a window."""
        if not self.up:
            return
        rpm_end, rps_end, model = counted
        now = time.monotonic()
        keys = []
        if rpm_end is not None and now < rpm_end - 0.05:
            keys.append(self._user_keys(user)[0])
        if rps_end is not None and now < rps_end - 0.05:
            keys.append(f"{self._p}:rps:{model}")
        if keys:
            fut = self._submit(UNCOUNT, keys, [])
            fut.add_done_callback(_retrieved)

    def settle(self, user: str, tokens: int, release: bool) -> None:
        """Charge tokens and release a slot in the background: the answer is already on its way."""
        if release:
            n = self.held.get(user, 0) - 1
            if n > 0:
                self.held[user] = n
            else:
                self.held.pop(user, None)
        self._settle(user, tokens, release)

    def _settle(self, user: str, tokens: int, release: bool) -> None:
        if not self.up:
            self._settle_failed(user, tokens, release)
            return
        _, k_tpm, k_conc = self._user_keys(user)
        fut = self._submit(SETTLE, [k_tpm, k_conc], [tokens, USER_WINDOW_MS, self.replica_id, 1 if release else 0])
        fut.add_done_callback(functools.partial(self._settled, user, tokens, release))

    def _settled(self, user: str, tokens: int, release: bool, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self._settle_failed(user, tokens, release)

    def _settle_failed(self, user: str, tokens: int, release: bool) -> None:
        if release:
            self._dirty.add(user)           # the next good sync publishes the exact count
        if tokens and self.reconcile:
            self._count_locally(self._user_keys(user)[1], tokens)
        elif tokens:
            # a standalone Redis: its outage's tokens are not added afterwards (as its requests are
            # not); counted, and said at most every UNCHARGED_LOG_EVERY_S, not once per request
            self._on_uncharged(tokens)
            self._uncharged[0] += tokens
            self._uncharged[1] += 1
            now = time.monotonic()
            if now - self._uncharged_logged >= UNCHARGED_LOG_EVERY_S:
                log.warning(f"tokens not charged: {trouble(self.down_reason)}", tokens=self._uncharged[0],
                            requests=self._uncharged[1], reason=self.down_reason or "unreachable")
                self._uncharged, self._uncharged_logged = [0, 0], now

    async def _repair(self) -> None:
        """Re-publish this replica's exact slot count for users whose release did not land (or,
        after an outage, every user it held slots for), in one pipeline."""
        users, self._dirty = self._dirty, set()
        pipe = self.client.pipeline(transaction=False)
        k_users = self._k_slot_users()
        for user in users:
            k_conc = self._user_keys(user)[2]
            n = self.held.get(user, 0)
            if n > 0:
                # listed as the limit check lists it, for a run after this one to take out
                pipe.hset(k_conc, self.replica_id, n).sadd(k_users, user).pexpire(k_users, SLOT_USERS_TTL_MS)
            else:
                pipe.hdel(k_conc, self.replica_id)
        try:
            await self._call(pipe.execute(), probe=True)
        except BaseException:               # kept for the next good sync, whatever went wrong
            self._dirty |= users
            raise

    async def _reconcile(self) -> None:
        """Add what was served while the state was unreachable to the shared windows (those whose
        local window has not ended), one script call a batch. A batch whose call fails is kept
        and sent again, with its marker, at the next good sync."""
        window_s = USER_WINDOW_MS / 1000
        if self._tally:
            self._batch += 1
            marker = f"{self._p}:reconciled:{self.replica_id}:{self._nonce}:{self._batch}"
            self._unsent.append((marker, self._tally))
            self._tally = {}
        while self._unsent:
            marker, batch = self._unsent[0]
            now = time.monotonic()
            live = {k: v for k, v in batch.items() if now - v[1] < window_s}
            if live:
                args: list = [USER_WINDOW_MS]
                for count, start in live.values():
                    args += (count, max(1, int((start + window_s - now) * 1000)))
                await self._call(self._evalsha(RECONCILE, [marker, *live], args), probe=True)
                rpm = sum(v[0] for k, v in live.items() if k.startswith(f"{self._p}:rpm:"))
                log.info("requests served while the shared state was unreachable are now counted",
                         requests=rpm, tokens=sum(v[0] for v in live.values()) - rpm, windows=len(live))
            self._unsent.pop(0)

    async def _evalsha(self, script: str, keys: list[str], args: list):
        try:
            return await self.client.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.execute_command("EVAL", script, len(keys), *keys, *args)

    async def usage(self, user: str) -> dict[str, int]:
        # the slots of a replica that stopped heartbeating (killed with requests in flight) are not
        # counted, as the limit check does not count them: they would stay in the hash until the
        # user's next admitted request
        k_rpm, k_tpm, k_conc = self._user_keys(user)
        req, req_ttl, tok, tok_ttl, conc = await self._call(
            self._evalsha(USAGE, [k_rpm, k_tpm, k_conc, self.k_replicas], [self.replica_id, self._ttl_ms]))
        req, tok = int(req), int(tok)
        return {"requests": req, "requests_reset_ms": max(0, int(req_ttl)) if req else 0,
                "tokens": tok, "tokens_reset_ms": max(0, int(tok_ttl)) if tok else 0,
                "concurrent": int(conc)}

    async def peek(self, users: list[str]) -> dict[str, dict[str, int]]:
        """Fleet-wide RPM/TPM window usage of several users in one round trip (the status page);
        ``concurrent`` is this replica's own slots, known without a call. A user whose window
        Redis cannot read as one (another application wrote a key of another type there) is left
        out, its usage unknown: an ``MGET`` reads such a key as absent, and showed it as none."""
        if not users:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for u in users:
            for k in self._user_keys(u)[:2]:
                pipe.get(k)
        vals = await self._call(pipe.execute(raise_on_error=False))
        out = {}
        for i, u in enumerate(users):
            req, tok = vals[2 * i], vals[2 * i + 1]
            if isinstance(req, Exception) or isinstance(tok, Exception):
                continue
            out[u] = {"requests": int(req or 0), "tokens": int(tok or 0), "concurrent": self.held.get(u, 0)}
        return out

    def slots(self) -> dict[str, int]:
        """The concurrency slots this replica (this process) holds, by user."""
        return {u: n for u, n in self.held.items() if n > 0}

    # -- fleet sync --------------------------------------------------------------------------

    async def sync(self, in_flight: dict[str, int] | None) -> tuple[str, dict[str, int]]:
        """Heartbeat, publish this replica's per-endpoint in-flight counts and read the others'
        sums and the directory version, in one round trip. Doubles as the reconnect probe."""
        flat: list = []
        for k, v in (in_flight or {}).items():
            flat += (k, v)
        out = await self._call(self._sync(
            keys=[self.k_replicas, self.k_inflight_prefix + self.replica_id, self.k_version, self.k_admin_tokens],
            args=[self.replica_id, self._ttl_ms, self.k_inflight_prefix,
                  1 if in_flight is not None else 0, self.admin_digest, *flat]), probe=True)
        if self.refused and (self.refused not in COMMAND_REFUSALS
                             or time.monotonic() - self._refused_at >= REFUSAL_HOLD_S):
            # the heartbeat's write landed: Redis takes writes again. A refused command (a key the
            # ACL user may not touch, a key of another type) may be one the heartbeat does not
            # send: it is over when none was met for a while, not at the first sync after it
            self.refused = ""
            self._tell()
        version = out[0].decode()
        if not self._beating:
            # a replica's first heartbeat: a run before it under the same name (a configured
            # replica_id: a worker started again after it died, a pod restarted) may have died with
            # slots in the users' hashes, which count as this run's now that it heartbeats under
            # that name; its exact counts (none yet, or what it took while this sync was on its
            # way) are published for every user the name held slots of
            users = await self._call(self.client.smembers(self._k_slot_users()), probe=True)
            self._dirty |= {u.decode() for u in users}
        if out[1] and self._beating:
            # this replica's heartbeat is gone while no call of its own failed: Redis restarted
            # (empty) or was flushed between two calls, or this replica was silent past the ttl and
            # the others dropped its slots. Either way the slots it holds are not in the shared
            # hashes: publish them again now, as after an outage
            log.warning("shared state lost this replica's heartbeat; its concurrency slots are published again",
                        replica=self.replica_id, users=len(self._slot_users))
            self._on_heartbeat_lost()
            self._dirty |= self._slot_users
        self._beating = True
        remote = {out[i].decode(): int(out[i + 1]) for i in range(2, len(out) - 1, 2)}
        if self._dirty:
            await _kept_if_refused(self._repair())
        if self._tally or self._unsent:
            await _kept_if_refused(self._reconcile())
        return version, remote

    async def publish_admin(self, digest: str) -> None:
        """This replica's admin token (its SHA-256; '' without one) as the others see it, at once: a
        reload's new token, before the next heartbeat (which publishes it too)."""
        self.admin_digest = digest
        if digest:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.k_admin_tokens, self.replica_id, digest).pexpire(self.k_admin_tokens, 86_400_000)
            await self._call(pipe.execute())
        else:
            await self._call(self.client.hdel(self.k_admin_tokens, self.replica_id))

    async def admin_digests(self) -> set[str]:
        """The SHA-256 of the admin token of every replica that heartbeats (a replica past
        ``replica_ttl_s`` is dropped by the next heartbeat of any, as from the replicas zset)."""
        return {v.decode() for v in await self._call(self.client.hvals(self.k_admin_tokens))}

    async def leave(self) -> None:
        """On shutdown: stop counting in the others' view at once instead of after the TTL."""
        # not a transaction (see WHOLE_DIRECTORY): the keys need not change in one step
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.k_replicas, self.replica_id).delete(self.k_inflight_prefix + self.replica_id)
        pipe.hdel(self.k_admin_tokens, self.replica_id)
        if not self.held and not self._dirty:   # no slot of its own left in any user's hash
            pipe.delete(self._k_slot_users())
        with contextlib.suppress(StateUnavailable):
            await self._call(pipe.execute())

    # -- directory store ---------------------------------------------------------------------

    async def load_directory(self) -> tuple[str, dict[str, UserLimits], dict[str, KeyRecord], str | None]:
        """The whole directory: its version, users, keys, and the tag of the write that made that
        version (None when the change log does not have it)."""
        version, users_flat, keys_flat, last = await self._call(
            self._evalsha(WHOLE_DIRECTORY, [self.k_version, self.k_users, self.k_keys, self.k_log], []), probe=True)
        users_raw = dict(zip(users_flat[::2], users_flat[1::2], strict=True))
        keys_raw = dict(zip(keys_flat[::2], keys_flat[1::2], strict=True))
        users, keys = {}, {}
        for name, data in users_raw.items():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                users[name.decode()] = limits_from_stored(orjson.loads(data))
        for digest, data in keys_raw.items():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                d = digest.decode()
                keys[d] = KeyRecord.from_stored(d, orjson.loads(data))
        version = (version or b"0").decode()
        tag = None
        if last:
            v, _, rest = last[0].decode().partition(":")
            if v == version:
                tag = rest.partition(":")[0]
        return version, users, keys, tag

    async def directory_changes(self, since: str, tag: str | None) -> tuple[
            str, dict[str, UserLimits | None], dict[str, KeyRecord | None], str | None] | None:
        """What changed in the directory since version ``since`` (whose write's tag is ``tag``, if
        known), read from the change log with each changed field's value now, in one step: the
        version, the users and keys changed (None: deleted) and the new version's tag. None when
        the log cannot say: the mirror is too far behind, a version since is missing from the log
        (trimmed, or written by a replica that keeps no log), or the store's version ``since`` may
        not be the one the mirror read (its tag differs or is unknown: the store may have lost
        writes and made others since, a restart between two syncs); then the caller reads the
        whole directory."""
        out = await self._call(self._evalsha(CHANGES, [self.k_users, self.k_keys, self.k_version, self.k_log],
                                             [since, MAX_CHANGES]), probe=True)
        version = out[0].decode()
        if version == since:
            return version, {}, {}, tag
        if not since.isdigit() or int(version) < int(since) or out[1:2] == [b"far"]:
            return None
        first = int(since)
        seen: set[int] = set()
        own: set[str] = set()
        new_tag: str | None = None
        users: dict[str, UserLimits | None] = {}
        keys: dict[str, KeyRecord | None] = {}
        for i in range(1, len(out) - 1, 2):
            v_text, etag, h, field = out[i].decode().split(":", 3)
            v = int(v_text)
            if v == first:
                own.add(etag)
                continue
            seen.add(v)
            if v == int(version):
                new_tag = etag
            data = out[i + 1]
            if h == "1":
                users[field] = None
                if data is not None:
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        users[field] = limits_from_stored(orjson.loads(data))
            elif h == "2":
                keys[field] = None
                if data is not None:
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        keys[field] = KeyRecord.from_stored(field, orjson.loads(data))
        # a mirror of version 0 had nothing to lose; any other must be of the history the log tells
        if seen != set(range(first + 1, int(version) + 1)) or (first and (tag is None or own != {tag})):
            return None
        return version, users, keys, new_tag

    async def get_key(self, digest: str) -> KeyRecord | None:
        data = await self._call(self.client.hget(self.k_keys, digest))
        if data is None:
            return None
        try:
            return KeyRecord.from_stored(digest, orjson.loads(data))
        except (ValueError, TypeError, KeyError):
            return None

    async def _write(self, *ops: tuple[str, int, str, bytes]) -> int | None:
        """One atomic directory change (and a version bump, so replicas reload their mirror): the
        number of key records a ``K`` op deleted, or None, and nothing written, when a condition
        (``N``: absent, ``X``, ``R``: present, ``P``: a record or a base to patch) failed.
        With Sentinel or a Cluster the answer waits until a replica has it (``WAIT 1``, up to
        most of ``timeout_s``): a key the admin API has shown once must survive a failover."""
        args: list = [secrets.token_hex(4), LOG_VERSIONS, *(x for op in ops for x in op)]
        keys = [self.k_users, self.k_keys, self.k_version, self.k_log, self.k_key_index, self.k_key_index_at,
                self.k_notes]
        out = await self._call(self._write_and_wait(keys, args))
        return int(out[1]) if isinstance(out, list) else None

    async def _write_and_wait(self, keys: list[str], args: list):
        if self.mode == "standalone":
            return await self.client.execute_command("EVAL", DIRECTORY, len(keys), *keys, *args)
        wait_ms = max(1, int(self.timeout * 800))       # the reply must come within the socket timeout
        pipe = self.client.pipeline(transaction=False)  # one connection: WAIT covers this write
        pipe.execute_command("EVAL", DIRECTORY, len(keys), *keys, *args)
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()
            pipe.execute_command("WAIT", 1, wait_ms, target_nodes=self.client.get_node_from_key(keys[2]))
        else:
            pipe.execute_command("WAIT", 1, wait_ms)
        written, acked = await pipe.execute()
        if not acked and isinstance(written, list):
            log.warning("directory change not yet on a replica: a failover now could lose it",
                        mode=self.mode, waited_ms=wait_ms)
        return written

    async def put_user(self, name: str, limits: UserLimits, only: str | None = None) -> bool:
        """Set the user's record; ``only="absent"`` (create) or ``"present"`` (change) makes it
        conditional on the store's current state, atomically: False when that does not hold."""
        return await self._write((_OP[only], 1, name, orjson.dumps(limits_stored(limits)))) is not None

    async def patch_user(self, name: str, changes: dict[str, Any], base: UserLimits | None) -> bool:
        """Set some of the user's limits (``models``: None removes the list) in its record as the
        store has it when the change runs (``base``: the record to start from if it has none, a
        configured user's); False, and nothing written, when there is neither."""
        patch = {"set": changes, **({"base": limits_stored(base)} if base is not None else {})}
        return await self._write(("P", 1, name, orjson.dumps(patch))) is not None

    async def delete_user(self, name: str) -> int | None:
        """Delete the user's record and every key of the user the store holds when it runs: how
        many keys, or None when the store had no record of the user."""
        return await self._write(("R", 1, name, b""), ("K", 2, name, b""))

    async def put_key(self, rec: KeyRecord, only: str | None = None) -> bool:
        """Set the key's record; ``only`` as for ``put_user``."""
        return await self._write((_OP[only], 2, rec.digest, orjson.dumps(rec.stored()))) is not None

    async def delete_key(self, digest: str) -> None:
        await self._write(("D", 2, digest, b""))


_OP = {None: "S", "absent": "N", "present": "X"}      # a directory write's condition → its op


def _raise_unavailable(results: list) -> None:
    """A pipeline answered with a transport failure in place of a result (a Cluster's pipeline
    does that): the whole batch failed as if the call had."""
    for r in results:
        if isinstance(r, UNAVAILABLE):
            raise r


async def _kept_if_refused(step) -> None:
    """Run a sync's repair or reconcile: one that Redis refused as a command (a user's key of
    another type, one the ACL user may not touch) is kept for the next sync, which tries it again,
    and this sync goes on (its directory refresh, the fleet's in-flight counts); it would otherwise
    fail every sync for as long as that one key stayed. Anything else fails the sync."""
    try:
        await step
    except StateUnavailable as e:
        if e.reason not in COMMAND_REFUSALS:
            raise


def _retrieved(fut: asyncio.Future) -> None:
    """A background call's outcome read (a failure gives back nothing, as documented)."""
    if not fut.cancelled():
        fut.exception()
