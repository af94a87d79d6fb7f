-- tokengate ledger v1: snapshot. ARGV: tpm, rpm (-1: none), tpd (-1: none).
-- Replies (JSON) with the fields of ledger::PoolSnapshot: {"tokens_available":_,"tokens_capacity":_,
-- "reserved_tokens":_,"in_flight_requests":_,"requests_available":_ (null: no request limit),
-- "day_tokens_available":_,"day_tokens_capacity":_,"day_full_in_ms":_ (null: no daily quota)}.
local now = now_ms()
local tpm, rpm, tpd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local s = load_synced(tpm, rpm, tpd, now)
purge(s, now)
save(s, now)
local requests = nil
if s.requests then
  requests = math.max(0, whole(s.requests))
end
local day_left, day_cap, day_full = nil, nil, nil
if s.day then
  day_left, day_cap, day_full = win_whole(s.day), s.day.cap, win_full_in(s.day, now)
end
return string.format(
  '{"tokens_available":%d,"tokens_capacity":%d,"reserved_tokens":%d,"in_flight_requests":%d,"requests_available":%s,"day_tokens_available":%s,"day_tokens_capacity":%s,"day_full_in_ms":%s}',
  whole(s.tokens), s.tokens.cap, s.reserved, redis.call('ZCARD', LEASES), json_int(requests),
  json_int(day_left), json_int(day_cap), json_int(day_full))
