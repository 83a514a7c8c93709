-- The sweeper's first look on one Redis (not a cluster, where a script may touch one
-- slot only): which of these outboxes hold a mark scored at the cutoff or less. Marks of
-- turns paused for their caller sit in the outboxes until their deadlines, so a
-- deployment with paused turns has marks in every batch: counted here, that batch is
-- one command, not one per outbox.
-- KEYS: the outboxes (sorted sets, one per slot)
-- ARGV: 1 cutoff ms
-- Reply: the outboxes holding a due mark, in the order given
if redis.call('EXISTS', unpack(KEYS)) == 0 then return {} end
local due = {}
for _, key in ipairs(KEYS) do
  if redis.call('ZCOUNT', key, '-inf', ARGV[1]) > 0 then due[#due + 1] = key end
end
return due
