-- tokengate ledger v1: settle. ARGV: member, reserved, charged, and for a reservation taken for a
-- route: route, guaranteed (tokens taken from its guarantee), recovered (0/1).
-- Credits back reserved - charged (or debits the excess) and ends the lease. A lease that already
-- expired was charged in full when it was purged: only a charge above the reservation is debited,
-- and the route's buckets keep what they lent.
-- Replies (JSON) {"held":_ (whether the lease was live),"purged":_}.
local now = now_ms()
local member, reserved, charged = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local s = load(now)
if not s then
  return '{"held":false,"purged":0}'
end
local t = s.tokens
refill(t, now)
local purged = purge(s, now)
local held = redis.call('ZREM', LEASES, member)
local delta = reserved - charged
if held == 1 then
  s.reserved = math.max(0, s.reserved - reserved)
else
  delta = math.min(0, delta)
end
t.level = math.min(t.level + delta * U, top(t))
local d = s.day
if d then
  win_refill(d, now)
  d.level = math.min(d.level + delta * d.w, d.cap * d.w)
end
local route = ARGV[4]
if route then
  local rs = route_get(route, now)
  if rs then
    if held == 1 then
      local guaranteed = tonumber(ARGV[5])
      local credit = guaranteed - math.min(charged, guaranteed)
      rs.g.level = math.min(rs.g.level + credit * U, rs.g.cap * U)
      if rs.c then
        rs.c.level = math.min(rs.c.level + delta * U, rs.c.cap * U)
      end
      if ARGV[6] == '1' then
        rs.v.level = math.min(rs.v.level + delta * U, rs.v.cap * U)
      end
    end
    rs.seen = math.max(rs.seen, now)
    route_save(route, rs)
  end
end
save(s, now)
return string.format('{"held":%s,"purged":%d}', tostring(held == 1), purged)
