-- A session lease let go by the attempt that holds it (worker/lease.py; a turn's end
-- releases it in turn_finish.lua instead): deleted only while it still holds this
-- attempt's token, so a worker never frees a lease another attempt holds.
-- KEYS: 1 the session's lease
-- ARGV: 1 the attempt's lease token
-- Reply: 1 released, 0 the lease holds another token or none
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
