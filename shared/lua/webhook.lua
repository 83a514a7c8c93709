-- Included by every script that writes a terminal event (`-- include: webhook.lua`); not
-- a script of its own.
-- Queues the turn's webhook in the same call as its terminal event, so no end is ever
-- without its delivery: the delivery's id (the same on every retry) and state on the
-- record, and the turn's mark in the slot's webhook outbox, due at once. `stored` is
-- the record's `webhook` field as the submit wrote it ({"url": ...}); a turn without
-- one costs nothing here.
local function webhook_queue(turn_key, outbox_key, member, turn_id, stored, now)
  if not stored or stored == '' then return end
  local ok, hook = pcall(cjson.decode, stored)
  if not ok or type(hook) ~= 'table' or type(hook.url) ~= 'string' then return end
  redis.call('HSET', turn_key, 'webhook',
    cjson.encode({url = hook.url, id = 'msg_' .. turn_id, state = 'pending'}))
  redis.call('ZADD', outbox_key, now, member)
end
