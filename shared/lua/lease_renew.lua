-- A session lease's renewal (worker/lease.py, the heartbeat): its expiry pushed on only
-- while it still holds this attempt's token, so a worker never extends a lease that
-- expired and was taken by another attempt meanwhile.
-- KEYS: 1 the session's lease
-- ARGV: 1 the attempt's lease token, 2 lease ms
-- Reply: 1 renewed, 0 the lease holds another token or none
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
