-- tokengate ledger, key layout v1: KEYS[1] = tg:v1:{pool}:s (hash), KEYS[2] = tg:v1:{pool}:l (zset).
-- This prelude is prepended to every script, after the constants src/ledger/scripts.rs formats in
-- from Rust (never copied here by hand): U (units per token: milliseconds per minute, from
-- ledger/units.rs), TRANSIT_MS (ledger/units.rs UPSTREAM_TRANSIT), PURGE_BATCH (expired leases
-- reclaimed per call) and KEY_GRACE_MS (how long an idle pool's keys outlive a full bucket).
--
-- Token buckets as in src/ledger/bucket.rs, at millisecond resolution: a level is kept in
-- "token-milliminutes" (one token is U units) and a bucket of C tokens per minute refills
-- exactly C units per elapsed millisecond of Redis TIME. Integers only: Lua numbers are doubles,
-- and every value here stays an integer below 2^53 (the client refuses limits that could pass it).
-- Stored numbers are written with '%.0f', never tostring (which keeps only 14 digits).
--
-- The state hash: tl/tc/tt = token level/capacity/updated ms; rl/rc/rt = the request bucket (absent
-- when the pool has no request limit); dl/dc/dt = the daily bucket (absent without tokens_per_day:
-- level in token-ticks, capacity, updated tick; see "Long windows" below); res = tokens held by
-- live leases (and slices); sl/sr = tokens and requests held by live slices (absent: none).
-- The lease zset: member "<id hex>:<tokens>", score = expiry in Redis ms. Its cardinality is the
-- number of requests in flight. A capacity slice (src/ledger/lease/, lua/slice.lua) is P members:
-- "<id hex>:<tokens>:<requests>" and P - 1 permits "<id hex>.<j>:0", so that it holds P permits.
--
-- Slices: tokens and requests a replica took to admit from in memory. They are out of the bucket
-- (taken as reservations are), and the bucket's refill and credits stop at its capacity less what
-- live slices hold (`top`): what a slice has not used yet was never sent upstream, whose own bucket
-- still counts it, so the shared level plus every slice's unused part never exceeds capacity.

local STATE, LEASES = KEYS[1], KEYS[2]

-- The time in milliseconds: Redis TIME, never a replica's clock. Every script calls it first
-- (a test build replaces it with lua/test_clock.lua, which takes the time from the arguments).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- floor(a / b) for integers (b > 0), exact: a double quotient may round across an integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function int(x)
  return string.format('%.0f', x)
end

-- Replies are JSON objects, one string.format per reply with a fixed template, decoded on the Rust
-- side with serde (src/ledger/scripts.rs). Integers go through '%d' (exact for every integer a
-- double holds), never cjson.encode, which prints numbers with 14 significant digits. A value
-- that may be absent is formatted with '%s' from `json_int`: the integer, or null.
local function json_int(x)
  if x == nil then
    return 'null'
  end
  return string.format('%d', x)
end

-- `held`: what live slices hold of it (see `top`).
local function bucket_new(cap, now)
  return { level = cap * U, cap = cap, ts = now, held = 0 }
end

-- The most a bucket may hold: its capacity less what live slices hold of it.
local function top(b)
  return math.max(0, b.cap - (b.held or 0)) * U
end

-- Adds what refilled since ts; never above `top`; time never runs backwards.
local function refill(b, now)
  if now > b.ts then
    local full = top(b)
    if b.cap > 0 and b.level < full then
      -- Clamp elapsed first so that elapsed * cap stays exact.
      local elapsed = math.min(now - b.ts, idiv(full - b.level, b.cap) + 1)
      b.level = math.min(b.level + elapsed * b.cap, full)
    end
    b.ts = now
  end
end

local function set_capacity(b, cap, now)
  refill(b, now)
  b.cap = cap
  b.level = math.min(b.level, top(b))
end

-- Milliseconds until `tokens` fit by refill alone: 0 if they fit now, -1 if never.
local function wait_for(b, tokens)
  local need = tokens * U
  if need <= b.level then
    return 0
  end
  if tokens > b.cap or b.cap == 0 then
    return -1
  end
  return idiv(need - b.level + b.cap - 1, b.cap)
end

-- Whole tokens now (negative while repaying a burndown debt).
local function whole(b)
  return idiv(b.level, U)
end

-- Long windows (src/ledger/window.rs): a bucket of `cap` tokens per window of `w` ticks of `tk`
-- ms (TICK_MS, or window / MAX_WINDOW_TICKS past a day), a token worth `w` units, refilling `cap`
-- units per tick: a full bucket stays below 2^53 units. `ts` is the tick last refilled.
local function win_new(cap, window_ms, now)
  local tk = math.max(TICK_MS, idiv(window_ms + MAX_WINDOW_TICKS - 1, MAX_WINDOW_TICKS))
  local w = math.max(1, idiv(window_ms, tk))
  return { level = cap * w, cap = cap, w = w, tk = tk, ts = idiv(now, tk) }
end

local function win_refill(b, now)
  local t = idiv(now, b.tk)
  if t > b.ts then
    local full = b.cap * b.w
    if b.cap > 0 and b.level < full then
      local elapsed = math.min(t - b.ts, idiv(full - b.level, b.cap) + 1)
      b.level = math.min(b.level + elapsed * b.cap, full)
    end
    b.ts = t
  end
end

local function win_set_capacity(b, cap, now)
  win_refill(b, now)
  b.cap = cap
  b.level = math.min(b.level, cap * b.w)
end

-- Milliseconds from now until the level reaches `units` (at a tick).
local function win_ms_to(b, units, now)
  local ticks = idiv(units - b.level + b.cap - 1, b.cap)
  return math.max(0, (b.ts + ticks) * b.tk - now)
end

-- Milliseconds until `tokens` fit by refill alone: 0 if they fit now, -1 if never.
local function win_wait(b, tokens, now)
  if tokens * b.w <= b.level then
    return 0
  end
  if tokens > b.cap or b.cap == 0 then
    return -1
  end
  return win_ms_to(b, tokens * b.w, now)
end

local function win_full_in(b, now)
  if b.cap == 0 or b.level >= b.cap * b.w then
    return 0
  end
  return win_ms_to(b, b.cap * b.w, now)
end

local function win_whole(b)
  return idiv(b.level, b.w)
end

local function load(now)
  local h = redis.call('HMGET', STATE, 'tl', 'tc', 'tt', 'rl', 'rc', 'rt', 'res', 'dl', 'dc', 'dt',
    'sl', 'sr')
  if not h[1] then
    return nil
  end
  local s = {
    tokens = { level = tonumber(h[1]), cap = tonumber(h[2]), ts = tonumber(h[3]),
      held = tonumber(h[11]) or 0 },
    reserved = tonumber(h[7]) or 0,
    requests_held = tonumber(h[12]) or 0,
  }
  if h[4] then
    s.requests = { level = tonumber(h[4]), cap = tonumber(h[5]), ts = tonumber(h[6]),
      held = s.requests_held }
  end
  if h[8] then
    s.day = win_new(tonumber(h[9]), DAY_MS, now)
    s.day.level, s.day.ts = tonumber(h[8]), tonumber(h[10])
  end
  return s
end

-- The daily bucket under this call's tokens_per_day (tpd < 0: none), refilled to now.
local function sync_day(s, tpd, now)
  if tpd < 0 then
    s.day = nil
  elseif s.day then
    if s.day.cap ~= tpd then
      win_set_capacity(s.day, tpd, now)
    end
    win_refill(s.day, now)
  else
    s.day = win_new(tpd, DAY_MS, now)
  end
end

-- The pool's state under the limits of this call (rpm < 0: no request limit; tpd < 0: no daily
-- quota), created full.
local function load_synced(tpm, rpm, tpd, now)
  local s = load(now)
  if not s then
    s = { tokens = bucket_new(tpm, now), reserved = 0, requests_held = 0 }
    if rpm >= 0 then
      s.requests = bucket_new(rpm, now)
    end
    sync_day(s, tpd, now)
    return s
  end
  sync_day(s, tpd, now)
  if s.tokens.cap ~= tpm then
    set_capacity(s.tokens, tpm, now)
  end
  refill(s.tokens, now)
  if s.requests and rpm >= 0 then
    if s.requests.cap ~= rpm then
      set_capacity(s.requests, rpm, now)
    end
    refill(s.requests, now)
  elseif rpm >= 0 then
    -- New, full up to its top: slices taken under an earlier request limit still hold requests.
    s.requests = bucket_new(rpm, now)
    s.requests.held = s.requests_held
    s.requests.level = math.min(s.requests.level, top(s.requests))
  else
    s.requests = nil
  end
  return s
end

-- Removes leases that expired (their holder stopped renewing: it crashed or lost Redis). Their
-- permits return; their tokens stay charged in full (see the module docs for why).
-- Expired slices the same: what they held stays charged, and no longer lowers the buckets' top.
local function purge(s, now)
  local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, PURGE_BATCH)
  for _, m in ipairs(expired) do
    local tokens, requests = string.match(m, '^[^:]+:(%d+):(%d+)$')
    if tokens then
      tokens, requests = tonumber(tokens), tonumber(requests)
      s.tokens.held = math.max(0, s.tokens.held - tokens)
      s.requests_held = math.max(0, s.requests_held - requests)
      if s.requests then
        s.requests.held = s.requests_held
      end
    else
      tokens = tonumber(string.match(m, ':(%d+)$')) or 0
    end
    s.reserved = math.max(0, s.reserved - tokens)
  end
  if #expired > 0 then
    redis.call('ZREM', LEASES, unpack(expired))
  end
  return #expired
end

local function to_full(b)
  if not b or b.cap == 0 or b.level >= b.cap * U then
    return 0
  end
  return idiv(b.cap * U - b.level + b.cap - 1, b.cap)
end

-- Sets a key's TTL to at least ms (never shortens it).
local function extend(key, ms)
  local current = redis.call('PTTL', key)
  if current == -1 or (current >= 0 and current < ms) then
    redis.call('PEXPIRE', key, ms)
  end
end

-- Writes the state back. Both keys live until every lease has expired and both buckets are full
-- again, plus KEY_GRACE_MS: a pool that expired is indistinguishable from a fresh, full one.
local function save(s, now)
  local t = s.tokens
  redis.call('HSET', STATE, 'tl', int(t.level), 'tc', int(t.cap), 'tt', int(t.ts), 'res', int(s.reserved))
  if (t.held or 0) > 0 or (s.requests_held or 0) > 0 then
    redis.call('HSET', STATE, 'sl', int(t.held or 0), 'sr', int(s.requests_held or 0))
  else
    redis.call('HDEL', STATE, 'sl', 'sr')
  end
  local r = s.requests
  if r then
    redis.call('HSET', STATE, 'rl', int(r.level), 'rc', int(r.cap), 'rt', int(r.ts))
  else
    redis.call('HDEL', STATE, 'rl', 'rc', 'rt')
  end
  local ttl = math.max(to_full(t), to_full(r))
  local d = s.day
  if d then
    redis.call('HSET', STATE, 'dl', int(d.level), 'dc', int(d.cap), 'dt', int(d.ts))
    -- The day's consumption outlives an idle pool: the keys last until the day is full again.
    ttl = math.max(ttl, win_full_in(d, now))
  else
    redis.call('HDEL', STATE, 'dl', 'dc', 'dt')
  end
  local last = redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')
  if last[2] then
    ttl = math.max(ttl, tonumber(last[2]) - now)
  end
  ttl = ttl + KEY_GRACE_MS
  extend(STATE, ttl)
  extend(LEASES, ttl)
end

-- Whether `tokens` (with `need` tokens in the bucket: the request's own and what it must leave
-- there), one request and one permit fit the pool now: nil if they do, else the refusal's limit,
-- wait (ms of refill, -1: never), deficit and held_for_others (`protected`: what it must leave
-- for other routes' guarantees). The daily quota is checked for the request's own tokens.
local function pool_refusal(s, tokens, need, protected, in_flight, max_concurrency, now)
  local t, r, d = s.tokens, s.requests, s.day
  if d and tokens * d.w > d.level then
    return 'daily_quota', win_wait(d, tokens, now), math.max(0, tokens - win_whole(d)), false
  end
  local token_fit = need * U <= t.level
  local request_fit = (not r) or U <= r.level
  if not token_fit or not request_fit then
    local token_wait = wait_for(t, need)
    local request_wait = -1
    if r then
      request_wait = wait_for(r, 1)
    end
    local deficit = math.max(0, need - whole(t))
    -- The limit with the longer wait binds; refill never satisfying counts as longest. Refill is a
    -- known wait and a free permit is not, so a short bucket binds even when permits are gone too.
    local tokens_bind = (not token_fit)
      and (request_fit or token_wait < 0 or (request_wait >= 0 and token_wait >= request_wait))
    if tokens_bind then
      return 'tokens', token_wait, deficit, protected > 0 and (need - protected) * U <= t.level
    end
    return 'requests', request_wait, deficit, false
  end
  if in_flight >= max_concurrency then
    return 'concurrency', 0, 0, false
  end
  return nil
end

-- Takes `tokens` and `requests` from the pool's buckets (and the day's); from a full bucket,
-- refill waits for the request to reach upstream (see TokenBucket::take_in_transit): upstream's
-- bucket stays capped until then.
local function take(s, tokens, requests, now)
  local t = s.tokens
  if t.level >= top(t) then
    t.ts = math.max(t.ts, now + TRANSIT_MS)
  end
  t.level = t.level - tokens * U
  if s.requests then
    s.requests.level = s.requests.level - requests * U
  end
  if s.day then
    s.day.level = s.day.level - tokens * s.day.w
  end
end

-- Route shares (see src/ledger/shares.rs for the rules). A route's buckets in a pool live in the
-- state hash, field 'r:<route>' = "gl gc gt cl cc ct vl vc vt seen": guarantee, ceiling (cc = -1:
-- none) and recovery buckets, and when the route last asked or settled (ms; NEVER: not yet. A
-- record written before NEVER existed says 0, which reads as an instant long past: the same).

local NEVER = -1

local function sync(b, cap, now)
  if b.cap ~= cap then
    set_capacity(b, cap, now)
  end
  refill(b, now)
end

-- A route's stored buckets refilled to now, or nil.
local function route_get(name, now)
  local raw = redis.call('HGET', STATE, 'r:' .. name)
  if not raw then
    return nil
  end
  local f = {}
  for x in string.gmatch(raw, '%S+') do
    f[#f + 1] = tonumber(x)
  end
  local r = {
    g = { level = f[1], cap = f[2], ts = f[3] },
    v = { level = f[7], cap = f[8], ts = f[9] },
    seen = f[10],
  }
  refill(r.g, now)
  refill(r.v, now)
  if f[5] >= 0 then
    r.c = { level = f[4], cap = f[5], ts = f[6] }
    refill(r.c, now)
  end
  return r
end

-- A route's buckets under the capacities of this call (ceiling < 0: none), created full.
local function route_load(name, g, c, v, now)
  local r = route_get(name, now)
  if not r then
    r = { g = bucket_new(g, now), v = bucket_new(v, now), seen = NEVER }
    if c >= 0 then
      r.c = bucket_new(c, now)
    end
    return r
  end
  sync(r.g, g, now)
  sync(r.v, v, now)
  if c < 0 then
    r.c = nil
  elseif r.c then
    sync(r.c, c, now)
  else
    r.c = bucket_new(c, now)
  end
  return r
end

local function route_save(name, r)
  local c = r.c or { level = 0, cap = -1, ts = 0 }
  redis.call('HSET', STATE, 'r:' .. name, table.concat({
    int(r.g.level), int(r.g.cap), int(r.g.ts), int(c.level), int(c.cap), int(c.ts),
    int(r.v.level), int(r.v.cap), int(r.v.ts), int(r.seen),
  }, ' '))
end

local function active(r, now, idle_ms)
  return r.seen ~= NEVER and now - r.seen < idle_ms
end
