-- Settle many claims in one call. Each operation is idempotent, so a batch delivered
-- twice (its drainer died before freeing it) changes nothing the second time.
--
-- promote  the hook is durable on this host under hook_id: write "c:<hook_id>" for the
--          rest of its dedupe window, whatever became of the claim -- over this host's
--          pending claim, over nothing (the claim expired, or was never written because
--          its call timed out, or Redis restarted empty), or over another host's pending
--          claim -- but never over another host's committed hook, which stays the original.
-- release  nothing was stored: delete the key, only while it holds this claim's token.
--
-- KEYS[i]          a dedupe key
-- ARGV[4i-3 .. 4i] op ("p" | "r"), token (a release's; '' for a promote), hook_id,
--                  ttl_ms (what is left of the window)
-- Returns          {promotes that wrote or found their hook, releases that found their token}
local promoted, released = 0, 0
for i = 1, #KEYS do
  local j = (i - 1) * 4
  local v = redis.call('GET', KEYS[i])
  if ARGV[j + 1] == 'p' then
    local mine = 'c:' .. ARGV[j + 3]
    if v == mine then
      promoted = promoted + 1
    elseif not v or string.sub(v, 1, 2) == 'p:' then
      redis.call('SET', KEYS[i], mine, 'PX', ARGV[j + 4])
      promoted = promoted + 1
    end
  elseif v == 'p:' .. ARGV[j + 2] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
return {promoted, released}
