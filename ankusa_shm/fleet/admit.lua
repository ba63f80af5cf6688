-- Fleet admission for one tenant's hooks, atomically and in order: for each hook, check
-- its dedupe key, charge the tenant's GCRA bucket, write the pending claim. One call
-- carries the hooks one worker admitted for the tenant in one turn of its event loop;
-- each is answered as it would be by a call of its own made at the same moment, so the
-- script's fixed cost is paid once per turn instead of once per hook. All keys carry the
-- tenant as their hash tag.
--
-- KEYS[1]    {prefix}:{tenant}:rl                 the tenant's TAT, microseconds
-- KEYS[1+i]  {prefix}:{tenant}:dd:<source>:<key>  hook i's: "p:<token>" | "c:<hook id>"
--            (KEYS[1] again for a hook that claims nothing)
-- ARGV       charge (0|1), interval_us, burst, pending_ttl_ms, then hook i's token
--            ('' claims nothing)
-- Returns    two entries per hook: 0, 0 admitted (claimed if asked) | 1, hook_id duplicate |
--            2, ms another claim pending | 3, ms rate limited |
--            4, why admitted, but the server refused to write: nothing of it recorded
-- A duplicate or pending key is not charged; a limited hook claims nothing. A key that
-- holds the hook's own token is this call sent again, its first reply lost with its
-- connection: admitted, as the first run was, and neither charged nor claimed twice.
--
-- A server that refuses writes (-OOM at maxmemory under noeviction, -READONLY on a replica,
-- -MISCONF when its snapshots fail) still answers reads: every hook is judged as ever, so a
-- resend of an event the fleet holds is still a duplicate and a tenant over its limit is
-- still limited, but a hook that would have been admitted is answered 4, with the refusal,
-- and its host answers it node-local. The refusal comes at a call's first write, before
-- anything of it is written, and nothing more is tried once it has.
local charge = ARGV[1] == '1'
local interval, burst, pending_ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local span = interval * burst
local now, tat, lead
if charge then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  -- Never more than a full burst ahead, which is as far as admits take it: after the
  -- server's clock is stepped back, a tenant is limited for one interval, not for the step
  -- (kept so: written back, even if nothing is admitted).
  if tat > now + span then tat, lead = now + span, span end
end

local refused
local function write(...)
  if not refused then
    local r = redis.pcall(...)
    if type(r) == 'table' and r.err then refused = r.err end
  end
end

local out, again_at = {}, {}
for i = 2, #KEYS do
  local token = ARGV[i + 3]
  local verdict, value, again = 0, 0, false
  if token ~= '' then
    local v = redis.call('GET', KEYS[i])
    if v then
      if string.sub(v, 1, 2) == 'c:' then
        verdict, value = 1, string.sub(v, 3)
      elseif v == 'p:' .. token then
        again = true
      else
        verdict, value = 2, math.max(1, redis.call('PTTL', KEYS[i]))
      end
    end
  end
  -- once refused, no charge is recorded
  if verdict == 0 and charge and not refused and not again then
    local ahead = tat - now + interval
    if ahead > span then
      verdict, value = 3, math.ceil((ahead - span) / 1000)
    else
      tat, lead = tat + interval, ahead
    end
  end
  if verdict == 0 and token ~= '' and not again then
    write('SET', KEYS[i], 'p:' .. token, 'PX', pending_ttl)
  end
  out[#out + 1] = verdict
  out[#out + 1] = value
  if again then again_at[#out - 1] = true end
end

if lead then
  -- %.0f: Lua would print a 16-digit number in exponent form and lose microseconds
  write('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil(lead / 1000) + 1)
end
if refused then
  for j = 1, #out, 2 do
    if out[j] == 0 and not again_at[j] then out[j], out[j + 1] = 4, refused end
  end
end
return out
