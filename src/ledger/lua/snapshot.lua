-- tokengate ledger v1: snapshot. ARGV: tpm, rpm (-1: none).
-- Returns {tokens_available, tokens_capacity, reserved, in_flight, requests_available (-1: none)}.
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local s = load_synced(tpm, rpm, now)
purge(s, now)
save(s, now)
local requests = -1
if s.requests then
  requests = math.max(0, whole(s.requests))
end
return { whole(s.tokens), s.tokens.cap, s.reserved, redis.call('ZCARD', LEASES), requests }
