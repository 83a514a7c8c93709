-- One page of a stream for an SSE catch-up, with the stream's first and last
-- entries, read at one instant: the first tells whether entries after the cursor
-- were trimmed away, the last where a live read of the stream may start.
-- KEYS: 1 stream
-- ARGV: 1 exclusive start ("(ms-seq"; "" = nothing can follow the cursor),
--       2 end id ("+" or an id), 3 page size
-- Reply: {first entry or {}, page, last entry or {}}
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local page = {}
if ARGV[1] ~= '' then
  page = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
end
return {first, page, last}
