-- Included by the scripts that write a session on its user's behalf
-- (`-- include: lifetime.lua`); not a script of its own.
-- include: contracts.lua
-- The session lifetime (TURNBUS_SESSION_TTL_DAYS) as `ttl` ms; nil, "" or "0": off, and
-- nothing is done. Every fixed key of the session whose key base is `base`
-- ("<prefix>:{<user>:<session>}") expires `ttl` ms from now (the lease keeps its own,
-- shorter expiry); each key of `capped` (a turn's record and events, an idempotency key:
-- keys with expiries of their own) expires no later than that.
local function session_lifetime(base, ttl, capped)
  if ttl == nil or ttl == '' or ttl == '0' then return end
  for _, suffix in ipairs(SESSION_LIFETIME_SUFFIXES) do
    redis.call('PEXPIRE', base .. suffix, ttl)
  end
  local limit = tonumber(ttl)
  for _, key in ipairs(capped) do
    local left = redis.call('PTTL', key)
    if left == -1 or left > limit then redis.call('PEXPIRE', key, ttl) end
  end
end
