-- Included by the scripts that advance a session's clock (`-- include: clock.lua`); not a
-- script of its own.
-- The LWW clock (updatedAt) as a decimal string, compared and incremented exactly: a
-- Lua number is a double, exact only up to 2^53, and string.format('%d') wraps at 2^63.
local function clock_of(v)
  if type(v) ~= 'string' then return '0' end
  -- A clock already without leading zeros (most are) is itself: no capture made.
  if string.find(v, '^[1-9]%d*$') then return v end
  return string.match(v, '^0*(%d+)$') or '0'
end
local function clock_cmp(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end
local function clock_max(a, b)
  return clock_cmp(a, b) >= 0 and a or b
end
local function clock_inc(a)
  -- A last digit below 9 (most clocks; `a` is digits, from clock_of) is the only one
  -- that changes.
  local last = string.byte(a, -1)
  if last ~= 57 then return string.sub(a, 1, -2) .. string.char(last + 1) end
  local i = #a
  while i > 0 and string.sub(a, i, i) == '9' do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #a) end
  return string.sub(a, 1, i - 1) .. string.char(string.byte(a, i) + 1) .. string.rep('0', #a - i)
end
-- The largest clock a JSON client holds exactly (2^53 - 1, shared.caps.UPDATED_AT_MAX).
local CLOCK_MAX = '9007199254740991'
-- A worker's clock: strictly newer than the stored one, never behind the wall, and never
-- past CLOCK_MAX, which no host could then follow (at the cap it stays there).
local function worker_clock(stored, now)
  local next_clock = clock_inc(clock_max(stored, now))
  if clock_cmp(next_clock, CLOCK_MAX) > 0 then return CLOCK_MAX end
  return next_clock
end
