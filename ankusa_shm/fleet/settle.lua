-- Settle many claims in one call: promote (pending -> committed under a hook id, for the
-- dedupe window) or release (delete), each only if the key still holds this claim's token.
--
-- KEYS[i]          a dedupe key
-- ARGV[4i-3 .. 4i] op ("p" | "r"), token, hook_id, ttl_ms
-- Returns          how many operations found their token and were applied
local applied = 0
for i = 1, #KEYS do
  local j = (i - 1) * 4
  if redis.call('GET', KEYS[i]) == 'p:' .. ARGV[j + 2] then
    if ARGV[j + 1] == 'p' then
      redis.call('SET', KEYS[i], 'c:' .. ARGV[j + 3], 'PX', ARGV[j + 4])
    else
      redis.call('DEL', KEYS[i])
    end
    applied = applied + 1
  end
end
return applied
