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
return reply({
  { 'tokens_available', whole(s.tokens) }, { 'tokens_capacity', s.tokens.cap },
  { 'reserved_tokens', s.reserved }, { 'in_flight_requests', redis.call('ZCARD', LEASES) },
  { 'requests_available', requests },
})
