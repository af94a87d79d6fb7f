-- tokengate ledger v1: slice (src/ledger/lease/). Gives a replica's capacity slice back and/or
-- takes a new one, in one round trip.
-- ARGV: tpm, rpm (-1: none), max_concurrency, lease_ms, tpd (-1: none);
--   the slice given back: id (hex; '-': none), tokens, requests, permits (as taken), unused tokens
--   (negative: its reservations were charged more than it held), unused requests, from_full (1: it
--   admitted while the pool's bucket may have been full);
--   the slice to take: id (hex; '-': none), least tokens (the request that asks), tokens,
--   requests, permits (the most to take), keep (tokens the bucket must still hold after it: a
--   route share's retry reserve), the asking route ('-': none) and its recovery (tokens per
--   minute), whose buckets are loaded and marked seen as admit.lua does for a share that has
--   neither guarantees nor ceilings, and its hold-back (tokens the bucket must hold beyond the
--   least tokens and keep, as admit.lua's hold_back);
--   then the given-back slice's reservations still in flight, as lease members "<id hex>:<tokens>":
--   they become leases of their own, settled and renewed as any other.
-- Given back: its members leave the lease set, what it did not use is credited (never above the
-- bucket's top), and it stops lowering the buckets' top. A slice that already expired was charged
-- in full when it was purged: nothing is credited and its reservations are not kept.
-- Taken: checked exactly as admit.lua checks a request of `least` tokens with its hold-back and a
-- share that keeps `keep` (the retry reserve), then as much as the pool holds up to the sizes asked
-- (at least the least tokens, one request and one permit), taken as a reservation is.
-- Replies (JSON) {"verdict":"returned"|"granted"|"refused","returned":_ (the slice given back was
-- live),"purged":_, and when granted "tokens":_,"requests":_,"permits":_ (what the slice holds);
-- when refused the fields of admit.lua's refusal}.
local now = now_ms()
local tpm, rpm, max_concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease_ms, tpd = tonumber(ARGV[4]), tonumber(ARGV[5])
local s = load_synced(tpm, rpm, tpd, now)
local purged = purge(s, now)
local t = s.tokens

-- A slice's lease members: the head carries its tokens and requests, the others one permit each.
local function members(id, tokens, requests, permits)
  local m = { id .. ':' .. int(tokens) .. ':' .. int(requests) }
  for j = 1, permits - 1 do
    m[#m + 1] = id .. '.' .. j .. ':0'
  end
  return m
end

local function set_requests_held(held)
  s.requests_held = math.max(0, held)
  if s.requests then
    s.requests.held = s.requests_held
  end
end

local function give_back()
  local id = ARGV[6]
  if id == '-' then
    return false
  end
  local tokens, requests, permits = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local unused, unused_requests, from_full = tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12] == '1'
  local m = members(id, tokens, requests, permits)
  if not redis.call('ZSCORE', LEASES, m[1]) then
    -- Expired and purged (its holder stopped answering for longer than a lease): charged in full.
    redis.call('ZREM', LEASES, unpack(m))
    return false
  end
  redis.call('ZREM', LEASES, unpack(m))
  -- Upstream's bucket, full when the slice admitted, refills only from when that request arrived:
  -- a bucket at its top restarts refill no earlier than a transit from now.
  if from_full and t.level >= top(t) then
    t.ts = math.max(t.ts, now + TRANSIT_MS)
  end
  s.reserved = math.max(0, s.reserved - tokens)
  t.held = math.max(0, t.held - tokens)
  set_requests_held(s.requests_held - requests)
  t.level = math.min(t.level + unused * U, top(t))
  local r = s.requests
  if r then
    r.level = math.min(r.level + unused_requests * U, top(r))
  end
  for i = 22, #ARGV do
    local lease_tokens = tonumber(string.match(ARGV[i], ':(%d+)$')) or 0
    s.reserved = s.reserved + lease_tokens
    redis.call('ZADD', LEASES, now + lease_ms, ARGV[i])
  end
  return true
end

local returned = give_back()
local id = ARGV[13]
if id == '-' then
  save(s, now)
  return string.format('{"verdict":"returned","returned":%s,"purged":%d}', tostring(returned), purged)
end
local least, tokens, requests, permits = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local keep, route, hold_back = tonumber(ARGV[18]), ARGV[19], tonumber(ARGV[21])
if route ~= '-' then
  local rs = route_load(route, 0, -1, tonumber(ARGV[20]), now)
  rs.seen = now
  route_save(route, rs)
end
local in_flight = redis.call('ZCARD', LEASES)
local limit, wait, deficit = pool_refusal(s, least, least + keep + hold_back, 0, in_flight, max_concurrency, now)
if limit then
  save(s, now)
  local wait_ms = nil
  if wait >= 0 then
    wait_ms = wait
  end
  return string.format(
    '{"verdict":"refused","returned":%s,"purged":%d,"limit":"%s","wait_ms":%s,"deficit":%d,"reserved":%d,"in_flight":%d,"held_for_others":false}',
    tostring(returned), purged, limit, json_int(wait_ms), deficit, s.reserved, in_flight)
end
tokens = math.max(least, math.min(tokens, whole(t) - keep))
if s.requests then
  requests = math.max(1, math.min(requests, whole(s.requests)))
else
  requests = 0
end
permits = math.max(1, math.min(permits, max_concurrency - in_flight))
take(s, tokens, requests, now)
s.reserved = s.reserved + tokens
t.held = t.held + tokens
set_requests_held(s.requests_held + requests)
local expiry = now + lease_ms
for _, m in ipairs(members(id, tokens, requests, permits)) do
  redis.call('ZADD', LEASES, expiry, m)
end
save(s, now)
return string.format('{"verdict":"granted","returned":%s,"purged":%d,"tokens":%d,"requests":%d,"permits":%d}',
  tostring(returned), purged, tokens, requests, permits)
