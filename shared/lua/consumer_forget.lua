-- A dead worker's consumer forgotten (worker/workqueue.py, WorkQueue.forget_dead) only
-- if it owes nothing, checked and deleted at once: an entry delivered to it after the
-- caller's look must not be dropped from the pending list with it.
-- KEYS: 1 a work stream
-- ARGV: 1 the consumer group, 2 the consumer
-- Reply: the pending count it had (0), or -1 when it owes some (then nothing changed)
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  return -1
end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
