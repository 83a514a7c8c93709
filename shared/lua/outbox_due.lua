-- The sweeper's look at one slot's outbox: the marks older than the grace period. A
-- turn still queued has had no worker call its start since it was accepted, so its work
-- entry may be lost: its mark is renewed (one more grace period before the next look)
-- and it is returned, to be enqueued again. Any other mark (the turn started, ended or
-- is gone) is dropped, but for a turn paused for its caller (requires_action), whose
-- mark falls due at the pause's deadline. The turns' records share the slot with the outbox.
-- KEYS: 1 a slot's outbox
-- ARGV: 1 key prefix, 2 now ms, 3 grace ms, 4 most marks to look at
-- Reply: the members (user:session:turn) to enqueue
-- include: contracts.lua
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]),
  'LIMIT', 0, tonumber(ARGV[4]))
local out = {}
for _, member in ipairs(due) do
  local user, session, tid = string.match(member, '^([^:]+):([^:]+):([^:]+)$')
  local status = false
  if tid then
    status = redis.call('HGET', ARGV[1] .. ':{' .. user .. ':' .. session .. '}:turn:' .. tid,
      'status')
  end
  -- A turn waiting for its caller keeps its mark at its deadline less the grace: due,
  -- it is enqueued, and the worker that starts it ends it (action_timeout).
  if status == STATUS.queued or status == STATUS.requires_action then
    redis.call('ZADD', KEYS[1], ARGV[2], member)
    table.insert(out, member)
  else
    redis.call('ZREM', KEYS[1], member)
  end
end
return out
