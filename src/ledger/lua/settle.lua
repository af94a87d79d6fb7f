-- tokengate ledger v1: settle. ARGV: member, reserved, charged.
-- Credits back reserved - charged (or debits the excess) and ends the lease. A lease that already
-- expired was charged in full when it was purged: only a charge above the reservation is debited.
-- Returns {held (1 if the lease was live), purged}.
local member, reserved, charged = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local s = load(now)
if not s then
  return { 0, 0 }
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
t.level = math.min(t.level + delta * U, t.cap * U)
save(s, now)
return { held, purged }
