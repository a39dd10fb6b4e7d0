"""The Lua scripts behind the Redis store: each operation is one atomic round trip.

Layout of one conversation hash (see `redis_store.conversation_key`):
    record              msgpack Conversation (absent until a turn finishes)
    handle              msgpack engine handle (absent when none, claimed or expired)
    handle_expires_at   wall-clock seconds; the handle is dead at or after it
    started, finished   turn counters: the last turn begun, the last turn whose outcome was stored
    started_at          when the last turn began (caller's wall clock), to age out abandoned turns
"""

# KEYS[1] conversation; ARGV: now, inflight_timeout_s, ttl_ms.
# Returns {turn, handle_state, record or nil, handle or nil}. Removing the handle in the same script as
# reading it is what makes a handle single use across every gateway replica.
BEGIN_TURN = """
local now = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'record', 'handle', 'handle_expires_at',
                     'started', 'finished', 'started_at')
local started = tonumber(v[4]) or 0
local finished = tonumber(v[5]) or 0
local state = 'none'
local handle = false
if v[2] then
  redis.call('HDEL', KEYS[1], 'handle', 'handle_expires_at')
  if (tonumber(v[3]) or 0) > now then
    state = 'claimed'
    handle = v[2]
  else
    state = 'expired'
  end
elseif started > finished and now - (tonumber(v[6]) or 0) < tonumber(ARGV[2]) then
  state = 'in_flight'
end
redis.call('HSET', KEYS[1], 'started', started + 1, 'started_at', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {started + 1, state, v[1], handle}
"""

# KEYS[1] conversation; ARGV: turn, record, handle ('' for none), handle_expires_at, ttl_ms.
# Returns 1 if stored, 0 if a newer turn began (or this one already finished): nothing changed then.
FINISH_TURN = """
local turn = tonumber(ARGV[1])
local v = redis.call('HMGET', KEYS[1], 'started', 'finished')
if tonumber(v[1]) ~= turn or (tonumber(v[2]) or 0) >= turn then
  return 0
end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'finished', ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'handle', ARGV[3], 'handle_expires_at', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'handle', 'handle_expires_at')
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# KEYS[1] conversation; ARGV: now. Returns the handle if it was still live, else nil.
# The counters go too, so turns restart at 1: a turn begun before the delete that finishes after a new
# turn 1 began can still store its record. Harmless: the next turn's continuity check judges any record.
DELETE = """
local v = redis.call('HMGET', KEYS[1], 'handle', 'handle_expires_at')
redis.call('DEL', KEYS[1])
if v[1] and (tonumber(v[2]) or 0) > tonumber(ARGV[1]) then
  return v[1]
end
return false
"""
