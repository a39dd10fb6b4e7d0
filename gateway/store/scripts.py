"""The Lua scripts behind the Redis store: each operation is one atomic round trip.

Keys (see `redis_store`): every key of one tenant starts with `pdgw:v2:{tenant}:`, so on Redis Cluster the
`{tenant}` hash tag puts all of them in one slot, and a script may touch a conversation and the tenant's
prefix index together (scripts also reach keys of that slot that they were not handed, such as a holder's
conversation or a conversation's old index entry).

Layout of one conversation hash, `pdgw:v2:{tenant}:conv:<session digest>`:
    record              msgpack Conversation (absent until a turn finishes), its block_hashes in `blocks`
    blocks, blocks_of   the record's block hashes, and `<turn>:<tag>` of the finish that wrote them (valid while
                        turn = finished; else the record carries its own, as an earlier script wrote it): a
                        turn sends only its new blocks' hashes (FINISH_TURN), and a begin naming the tag it
                        holds them under is not sent them back (store/known.py)
    handle              msgpack engine handle (absent when none, claimed or expired)
    handle_expires_at   wall-clock seconds; the handle is dead at or after it
    started, finished   turn counters: the last turn begun, the last turn whose outcome was stored
    started_at          when the last turn began (caller's wall clock), to age out abandoned turns
    session             the session id itself, so a prefix lookup can name the conversation it found
    held                the record's held_tokens R, so a lookup skips holders longer than the prompt
    indexed             the 16-byte index hash this conversation is filed under in the prefix index, if any
    evicted             the finished turn whose handle EVICT_HANDLE took; the next begin reports it, once

The prefix index, one sorted set per indexed hash: `pdgw:v2:{tenant}:pfx:<16 raw bytes>`, members the
session digests of the conversations filed there, scores their handle's expiry. A conversation is a member
exactly while it has an unclaimed handle (the score tells whether it is still live): FINISH_TURN files it,
a claim (BEGIN_TURN, BEGIN_FOUND_TURN) or DELETE removes it, a newer FINISH_TURN moves it and PUT_BACK
files it again. So the index holds at most one entry per conversation; each set expires with the
conversations in it.
"""

# Drop the conversation's index entry, if it has one. ARGV-independent so every script can share it.
_UNINDEX = """
local function unindex(conv, tenant_prefix, member)
  local indexed = redis.call('HGET', conv, 'indexed')
  if indexed then
    redis.call('ZREM', tenant_prefix .. 'pfx:' .. indexed, member)
    redis.call('HDEL', conv, 'indexed')
  end
end
"""

# File the conversation in the prefix index under `digest` while its handle lives (until `expires_at`).
_FILE = """
local function file(conv, tenant_prefix, member, digest, expires_at, now, ttl_ms)
  local index = tenant_prefix .. 'pfx:' .. digest
  -- Dead handles leave first, so a set shared by many identical conversations stays the size of its
  -- live holders; the set itself expires with the newest conversation filed in it.
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
  redis.call('ZADD', index, expires_at, member)
  redis.call('PEXPIRE', index, ttl_ms)
  redis.call('HSET', conv, 'indexed', digest)
end
"""

# The record's block hashes, kept beside it in `blocks` so a turn sends only its new blocks (FINISH_TURN);
# valid only when written with the record now stored (`blocks_of` = `<finished>:<the writer's tag>`): a record
# written without them (by an earlier layout's script) carries its own. `known`: the `blocks_of` the caller
# holds the hashes of (store/known.py); then 1 ("as you hold them") instead of the bytes.
_BLOCKS = """
local function blocks_of(blocks, tag, finished, known)
  if not blocks or not tag or not finished or string.sub(tag, 1, #finished + 1) ~= finished .. ':' then
    return false
  end
  if known and known == tag then
    return 1
  end
  return blocks
end
"""

# Begin a turn on `conv`: {turn, handle_state, record or nil, handle or nil, handle_expires_at or nil, blocks
# or nil}. Removing the handle in the same script as reading it is what makes a handle single use across every
# gateway replica; its index entry goes with it, so a lookup never offers a handle that is gone.
_BEGIN = _UNINDEX + _BLOCKS + """
local function begin(conv, now_arg, inflight_timeout_s, ttl_ms, tenant_prefix, member, known)
  local now = tonumber(now_arg)
  local v = redis.call('HMGET', conv, 'record', 'handle', 'handle_expires_at',
                       'started', 'finished', 'started_at', 'evicted', 'blocks', 'blocks_of')
  local started = tonumber(v[4]) or 0
  local finished = tonumber(v[5]) or 0
  local state = 'none'
  local handle = false
  local expires_at = false
  if v[2] then
    redis.call('HDEL', conv, 'handle', 'handle_expires_at')
    unindex(conv, tenant_prefix, member)
    if (tonumber(v[3]) or 0) > now then
      state = 'claimed'
      handle = v[2]
      expires_at = v[3]
    else
      state = 'expired'
    end
  elseif started > finished and now - (tonumber(v[6]) or 0) < tonumber(inflight_timeout_s) then
    state = 'in_flight'
  elseif v[7] and tonumber(v[7]) == finished and started == finished then
    state = 'evicted'
  end
  if v[7] then
    redis.call('HDEL', conv, 'evicted')
  end
  redis.call('HSET', conv, 'started', started + 1, 'started_at', now_arg)
  redis.call('PEXPIRE', conv, ttl_ms)
  return {started + 1, state, v[1], handle, expires_at, blocks_of(v[8], v[9], v[5], known)}
end
"""

# KEYS[1] conversation; ARGV: now, inflight_timeout_s, ttl_ms, tenant prefix, session digest, known blocks tag
# ('' for none). Returns `begin`'s.
BEGIN_TURN = _BEGIN + """
return begin(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""

# KEYS[1] conversation; ARGV: now, turn (the one whose record the lookup returned), ttl_ms, tenant prefix,
# session digest, known blocks tag. Returns {turn, record, handle, handle_expires_at, blocks} having claimed the
# handle as BEGIN_TURN does, or nil having changed nothing: a conversation that moved on (a newer record), has a
# turn in flight, or whose handle is claimed or dead is not touched, so a sessionless request can never disturb
# someone else's turn counters.
BEGIN_FOUND_TURN = _UNINDEX + _BLOCKS + """
local turn = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'record', 'handle', 'handle_expires_at', 'started', 'finished',
                     'blocks', 'blocks_of')
if not v[1] or not v[2] or tonumber(v[4]) ~= turn or tonumber(v[5]) ~= turn
   or (tonumber(v[3]) or 0) <= tonumber(ARGV[1]) then
  return false
end
redis.call('HDEL', KEYS[1], 'handle', 'handle_expires_at')
unindex(KEYS[1], ARGV[4], ARGV[5])
redis.call('HSET', KEYS[1], 'started', turn + 1, 'started_at', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {turn + 1, v[1], v[2], v[3], blocks_of(v[6], v[7], v[5], ARGV[6])}
"""

# KEYS[1] conversation; ARGV: turn, record, handle ('' for none), handle_expires_at, ttl_ms, now,
# tenant prefix, session digest, session, held_tokens, index hash ('' for none: no live handle to offer),
# kept (bytes of the stored block hashes the record keeps), seam (the last 16 of those kept bytes, '' when none
# are kept), the record's block hashes after the kept ones, the writer's tag for them (store/known.py).
# Returns 1 if stored, 0 if a newer turn began (or this one already finished): nothing changed then; 2 (nothing
# changed either) when the stored block hashes do not end the kept bytes with `seam`: send them all (kept 0).
# Chained hashes: an equal seam means equal hashes before it, so the stored blocks are the record's exactly.
# The index moves in the same script as the record, so no lookup ever sees one without the other.
FINISH_TURN = _UNINDEX + _FILE + _BLOCKS + """
local turn = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'started', 'finished', 'blocks', 'blocks_of')
if tonumber(v[1]) ~= turn or (tonumber(v[2]) or 0) >= turn then
  return 0
end
local kept = tonumber(ARGV[12])
local blocks = ARGV[14]
if kept > 0 then
  local old = blocks_of(v[3], v[4], v[2], false)
  if not old or #old < kept or string.sub(old, kept - 15, kept) ~= ARGV[13] then
    return 2
  end
  blocks = string.sub(old, 1, kept) .. blocks
end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'finished', ARGV[1], 'session', ARGV[9], 'held', ARGV[10],
           'blocks', blocks, 'blocks_of', ARGV[1] .. ':' .. ARGV[15])
redis.call('HDEL', KEYS[1], 'evicted')
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'handle', ARGV[3], 'handle_expires_at', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'handle', 'handle_expires_at')
end
unindex(KEYS[1], ARGV[7], ARGV[8])
if ARGV[11] ~= '' then
  file(KEYS[1], ARGV[7], ARGV[8], ARGV[11], ARGV[4], ARGV[6], ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# KEYS[1] conversation; ARGV: turn (the one the begin returned), handle ('' for none), handle_expires_at,
# now, ttl_ms, tenant prefix, session digest, index hash ('' for none: no live handle to offer), evicted
# ('1': the begin reported an eviction). Returns 1 having undone that begin (the counter back, the handle and
# its index entry back, the eviction reported again), or 0 having changed nothing: a turn began since (it
# saw this one in flight and owns the counter now), or this one finished, or the conversation was deleted.
PUT_BACK = _FILE + """
local turn = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'started', 'finished')
if tonumber(v[1]) ~= turn or (tonumber(v[2]) or 0) >= turn then
  return 0
end
redis.call('HSET', KEYS[1], 'started', turn - 1)
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'handle', ARGV[2], 'handle_expires_at', ARGV[3])
  if ARGV[8] ~= '' then
    file(KEYS[1], ARGV[6], ARGV[7], ARGV[8], ARGV[3], ARGV[4], ARGV[5])
  end
end
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[1], 'evicted', v[2] or '0')
end
return 1
"""

# KEYS[1] conversation; ARGV: now, tenant prefix, session digest. Returns the handle if it was still live,
# else nil. The counters go too, so turns restart at 1: a turn begun before the delete that finishes after a
# new turn 1 began can still store its record. Harmless: the next turn's continuity check judges any record.
DELETE = _UNINDEX + """
local v = redis.call('HMGET', KEYS[1], 'handle', 'handle_expires_at')
unindex(KEYS[1], ARGV[2], ARGV[3])
redis.call('DEL', KEYS[1])
if v[1] and (tonumber(v[2]) or 0) > tonumber(ARGV[1]) then
  return v[1]
end
return false
"""

# The tenant's holders at the prompt's chained block hashes ARGV[first..], read-only: up to `limit`, longest
# prefix first, each {blocks, session, finished, started, record, handle_expires_at or nil, blocks or nil}. A
# prefix whose holders are all dead, gone or longer than the prompt does not stop the walk: a shorter prefix
# may still hold a conversation this prompt extends. Needs _BLOCKS before it.
_FIND = """
local function find(now, limit_arg, tokens_arg, prefix, first)
  local limit = tonumber(limit_arg)
  local tokens = tonumber(tokens_arg)
  local out = {}
  for i = #ARGV, first, -1 do
    local members = redis.call('ZRANGEBYSCORE', prefix .. 'pfx:' .. ARGV[i], '(' .. now, '+inf',
                               'LIMIT', 0, limit)
    for _, member in ipairs(members) do
      local v = redis.call('HMGET', prefix .. 'conv:' .. member, 'record', 'session', 'held', 'finished',
                           'started', 'handle', 'handle_expires_at', 'blocks', 'blocks_of')
      if v[1] and v[2] and (tonumber(v[3]) or 0) <= tokens then
        out[#out + 1] = {i - first + 1, v[2], v[4] or '0', v[5] or '0', v[1], v[6] and v[7] or false,
                         blocks_of(v[8], v[9], v[4], false)}
        if #out >= limit then
          return out
        end
      end
    end
  end
  return out
end
"""

# KEYS[1] the tenant's index prefix (routing only: it names the slot); ARGV: now, limit, prompt tokens,
# tenant prefix, then the prompt's chained block hashes, first block first. Returns `find`'s holders.
FIND_BY_PREFIX = _BLOCKS + _FIND + """
return find(ARGV[1], ARGV[2], ARGV[3], ARGV[4], 5)
"""

# KEYS[1] the tenant's index prefix, KEYS[2] a new conversation (same tenant: same slot); ARGV: now, limit,
# prompt tokens, tenant prefix, inflight_timeout_s, ttl_ms, the new conversation's session digest, then the
# prompt's block hashes. A sessionless turn's lookup and, when it finds no holder at all, its new
# conversation's begin, in one round trip: {holders} or {{}, `begin`'s reply}.
FIND_OR_BEGIN = _BEGIN + _FIND + """
local out = find(ARGV[1], ARGV[2], ARGV[3], ARGV[4], 8)
if #out > 0 then
  return {out}
end
return {out, begin(KEYS[2], ARGV[1], ARGV[5], ARGV[6], ARGV[4], ARGV[7], false)}
"""

# KEYS[1] conversation; ARGV: turn, now, tenant prefix, session digest. Takes the handle only if `turn` stored it and no later turn began
# (a begun turn has claimed it: never taken from under a reader), marks the conversation evicted, and returns
# the handle if it was still live, else nil. The conversation's TTL is left as it is.
EVICT_HANDLE = _UNINDEX + """
local turn = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'started', 'finished', 'handle', 'handle_expires_at')
if not v[3] or tonumber(v[1]) ~= turn or tonumber(v[2]) ~= turn then
  return false
end
redis.call('HDEL', KEYS[1], 'handle', 'handle_expires_at')
unindex(KEYS[1], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[1], 'evicted', ARGV[1])
if (tonumber(v[4]) or 0) > tonumber(ARGV[2]) then
  return v[3]
end
return false
"""

# KEYS: replicas sorted set; ARGV: replica id, now, expires_at, key ttl ms. A heartbeat and the count of replicas
# alive, in one round trip; the set is the only key shared by every tenant, touched every few seconds per
# replica, never on a turn's path (its own slot on Cluster).
REPLICAS = """
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('ZCARD', KEYS[1])
"""
