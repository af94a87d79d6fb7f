-- tokengate ledger v1: renew. ARGV: lease_ms, member...
-- Pushes the expiry of each live lease to now + lease_ms. Returns the members no longer held
-- (expired and purged, or settled meanwhile).
local now = now_ms()
local lease_ms = tonumber(ARGV[1])
local s = load(now)
local missing = {}
if not s then
  for i = 2, #ARGV do
    missing[#missing + 1] = ARGV[i]
  end
  return missing
end
purge(s, now)
for i = 2, #ARGV do
  if redis.call('ZSCORE', LEASES, ARGV[i]) then
    redis.call('ZADD', LEASES, now + lease_ms, ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
save(s, now)
return missing
