-- tokengate ledger v1: admit. ARGV: member, tokens, tpm, rpm (-1: none), max_concurrency, lease_ms,
-- hold_back (tokens the bucket must keep beyond this request), tpd (tokens per day, -1: none), then
-- the route shares: n (0: none),
-- and when n > 0: caller (1-based), retry (0/1), retry_reserve, priority_margin (tokens), idle_ms,
-- and per route: name, priority, guaranteed, ceiling (-1: none), recovery (tokens per minute).
-- Takes tokens, one request and one permit (a lease), and the caller's share, all or nothing.
-- Replies (JSON) either
--   {"verdict":"granted","purged":_,"guaranteed":_,"recovered":_} or
--   {"verdict":"refused","purged":_,"limit":"tokens"|"requests"|"concurrency"|"share"|"daily_quota",
--    "wait_ms":_ (null: refill never makes room),"deficit":_,"reserved":_,"in_flight":_,
--    "held_for_others":_ (the bucket held the request but not what it must leave for other routes)}
-- purged: expired leases reclaimed by this call.
local now = now_ms()
local member, tokens = ARGV[1], tonumber(ARGV[2])
local tpm, rpm, max_concurrency, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local hold_back, tpd = tonumber(ARGV[7]), tonumber(ARGV[8])
local s = load_synced(tpm, rpm, tpd, now)
local purged = purge(s, now)
local in_flight = redis.call('ZCARD', LEASES)
local t = s.tokens

-- The caller's share: what the bucket must hold (need) and what the route takes.
local n = tonumber(ARGV[9] or '0')
local need = tokens
local protected = 0
local me, rs, hold_g, recovered = nil, nil, 0, false

-- Turns the request away: keeps what this call updated (refill, the caller's last-seen time),
-- takes nothing. wait: milliseconds of refill until it fits, -1 if refill never makes room.
local function refused(limit, wait, deficit, held_for_others)
  if rs then
    route_save(me.name, rs)
  end
  save(s, now)
  local wait_ms = nil
  if wait >= 0 then
    wait_ms = wait
  end
  return string.format(
    '{"verdict":"refused","purged":%d,"limit":"%s","wait_ms":%s,"deficit":%d,"reserved":%d,"in_flight":%d,"held_for_others":%s}',
    purged, limit, json_int(wait_ms), deficit, s.reserved, in_flight, tostring(held_for_others))
end

if n > 0 then
  local caller, retry = tonumber(ARGV[10]), ARGV[11] == '1'
  local reserve, margin, idle_ms = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
  local routes = {}
  for i = 1, n do
    local b = 14 + (i - 1) * 5
    routes[i] = {
      name = ARGV[b + 1], priority = tonumber(ARGV[b + 2]), g = tonumber(ARGV[b + 3]),
      c = tonumber(ARGV[b + 4]), v = tonumber(ARGV[b + 5]),
    }
  end
  me = routes[caller]
  rs = route_load(me.name, me.g, me.c, me.v, now)
  rs.seen = now
  if rs.c and tokens * U > rs.c.level then
    return refused('share', wait_for(rs.c, tokens), math.max(0, tokens - whole(rs.c)), false)
  end
  hold_g = math.min(math.max(whole(rs.g), 0), tokens)
  if hold_g < tokens then
    local outranked = false
    for i = 1, n do
      if i ~= caller then
        -- Read, not written: another route's buckets change only when it asks or settles.
        local other = route_get(routes[i].name, now)
        if other and active(other, now, idle_ms) then
          protected = protected + math.max(math.min(whole(other.g), routes[i].g), 0)
          if routes[i].priority > me.priority then
            outranked = true
          end
        end
      end
    end
    if outranked then
      protected = protected + margin
    end
  end
  need = tokens + protected + reserve
  -- Whether a retry dips into the reserve is judged on what the bucket holds beyond the
  -- hold-back, which it must keep either way (src/ledger/shares.rs, `need`).
  if retry and reserve > 0 and (need + hold_back) * U > t.level and tokens * U <= rs.v.level
    and (tokens + protected + hold_back) * U <= t.level then
    need = tokens + protected
    recovered = true
  end
end

-- The daily quota is checked for the request's own tokens (src/ledger/memory.rs checks it at the
-- same point), the bucket for what it needs.
local limit, wait, deficit, held_for_others =
  pool_refusal(s, tokens, need + hold_back, protected, in_flight, max_concurrency, now)
if limit then
  return refused(limit, wait, deficit, held_for_others)
end
take(s, tokens, 1, now)
if rs then
  rs.g.level = rs.g.level - hold_g * U
  if rs.c then
    rs.c.level = rs.c.level - tokens * U
  end
  if recovered then
    rs.v.level = rs.v.level - tokens * U
  end
  route_save(me.name, rs)
end
s.reserved = s.reserved + tokens
redis.call('ZADD', LEASES, now + lease_ms, member)
save(s, now)
return string.format('{"verdict":"granted","purged":%d,"guaranteed":%d,"recovered":%s}',
  purged, hold_g, tostring(recovered))
