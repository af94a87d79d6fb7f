-- tokengate ledger v1: admit. ARGV: member, tokens, tpm, rpm (-1: none), max_concurrency, lease_ms.
-- Takes tokens, one request and one permit (a lease), all or nothing.
-- Returns {1, purged} when admitted, or
-- {0, purged, limit (1 tokens, 2 requests, 3 concurrency), wait_ms (-1: never), deficit, reserved, in_flight}.
local member, tokens = ARGV[1], tonumber(ARGV[2])
local tpm, rpm, max_concurrency, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local s = load_synced(tpm, rpm, now)
local purged = purge(s, now)
local in_flight = redis.call('ZCARD', LEASES)
local t, r = s.tokens, s.requests

local token_fit = tokens * U <= t.level
local request_fit = (not r) or U <= r.level
if not token_fit or not request_fit then
  local token_wait = wait_for(t, tokens)
  local request_wait = -1
  if r then
    request_wait = wait_for(r, 1)
  end
  local deficit = math.max(0, tokens - whole(t))
  -- The limit with the longer wait binds; refill never satisfying counts as longest. Refill is a
  -- known wait and a free permit is not, so a short bucket binds even when permits are gone too.
  local tokens_bind = (not token_fit)
    and (request_fit or token_wait < 0 or (request_wait >= 0 and token_wait >= request_wait))
  save(s, now)
  if tokens_bind then
    return { 0, purged, 1, token_wait, deficit, s.reserved, in_flight }
  end
  return { 0, purged, 2, request_wait, deficit, s.reserved, in_flight }
end
if in_flight >= max_concurrency then
  save(s, now)
  return { 0, purged, 3, 0, 0, s.reserved, in_flight }
end
t.level = t.level - tokens * U
if r then
  r.level = r.level - U
end
s.reserved = s.reserved + tokens
redis.call('ZADD', LEASES, now + lease_ms, member)
save(s, now)
return { 1, purged }
