-- One hook's fleet admission, atomically: check the dedupe key, charge the tenant's GCRA
-- bucket, write the pending claim. Both keys carry the tenant as their hash tag.
--
-- KEYS[1]  {prefix}:{tenant}:rl                 the tenant's TAT, microseconds
-- KEYS[2]  {prefix}:{tenant}:dd:<source>:<key>  "p:<token>" pending | "c:<hook id>" committed
-- ARGV     charge (0|1), claim (0|1), interval_us, burst, token, pending_ttl_ms
-- Returns  {0} admitted (claimed if asked) | {1, hook_id} duplicate |
--          {2, ms} another claim pending | {3, ms} rate limited
-- A duplicate or pending key is not charged; a limited hook claims nothing.
local charge, claim = ARGV[1] == '1', ARGV[2] == '1'

if claim then
  local v = redis.call('GET', KEYS[2])
  if v then
    if string.sub(v, 1, 2) == 'c:' then
      return {1, string.sub(v, 3)}
    end
    local left = redis.call('PTTL', KEYS[2])
    if left < 1 then left = 1 end
    return {2, left}
  end
end

if charge then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local interval, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  local lead = tat - now + interval
  local span = interval * burst
  if lead > span then
    return {3, math.ceil((lead - span) / 1000)}
  end
  -- %.0f: Lua would print a 16-digit number in exponent form and lose microseconds
  redis.call('SET', KEYS[1], string.format('%.0f', tat + interval),
             'PX', math.ceil(lead / 1000) + 1)
end

if claim then
  redis.call('SET', KEYS[2], 'p:' .. ARGV[5], 'PX', ARGV[6])
end
return {0}
