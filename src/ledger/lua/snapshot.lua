-- tokengate ledger v1: snapshot. ARGV: tpm, rpm (-1: none).
-- Replies (JSON) with the fields of ledger::PoolSnapshot: {"tokens_available":_,"tokens_capacity":_,
-- "reserved_tokens":_,"in_flight_requests":_,"requests_available":_ (null: no request limit)}.
local now = now_ms()
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local s = load_synced(tpm, rpm, now)
purge(s, now)
save(s, now)
local requests = nil
if s.requests then
  requests = math.max(0, whole(s.requests))
end
return string.format(
  '{"tokens_available":%d,"tokens_capacity":%d,"reserved_tokens":%d,"in_flight_requests":%d,"requests_available":%s}',
  whole(s.tokens), s.tokens.cap, s.reserved, redis.call('ZCARD', LEASES), json_int(requests))
