-- tokengate ledger v1: budget. KEYS[1] = tg:v1:{budget:SCOPE}:b (hash: one field per window,
-- "level cap window_ms tick", see "Long windows" in common.lua and src/ledger/budget.rs).
-- ARGV: op ("take" | "settle" | "snapshot"), tokens, charged, n, then per window: name, capacity,
-- window_ms. Windows the call does not name are forgotten; a window whose length changed starts
-- full again; a capacity change keeps the level within it.
-- Replies (JSON): take: {"verdict":"taken"} or {"verdict":"refused","window":_,"wait_ms":_ (null:
-- never),"deficit":_}; settle: {"verdict":"settled"}; snapshot: an array, in the order given, of
-- {"available":_,"capacity":_,"full_in_ms":_}.
local now = now_ms()
local B = KEYS[1]
local op, tokens, charged, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ws, named = {}, {}
for i = 1, n do
  local b = 4 + (i - 1) * 3
  local name, cap, window_ms = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local raw = redis.call('HGET', B, name)
  local w = nil
  if raw then
    local f = {}
    for x in string.gmatch(raw, '%S+') do
      f[#f + 1] = tonumber(x)
    end
    if f[3] == window_ms then
      w = win_new(f[2], window_ms, now)
      w.level, w.ts = f[1], f[4]
      if w.cap ~= cap then
        win_set_capacity(w, cap, now)
      end
      win_refill(w, now)
    end
  end
  if not w then
    w = win_new(cap, window_ms, now)
  end
  w.name, w.window_ms = name, window_ms
  ws[i] = w
  named[name] = true
end

local function save_all()
  local ttl = 0
  for _, w in ipairs(ws) do
    redis.call('HSET', B, w.name, table.concat({ int(w.level), int(w.cap), int(w.window_ms), int(w.ts) }, ' '))
    ttl = math.max(ttl, win_full_in(w, now))
  end
  for _, field in ipairs(redis.call('HKEYS', B)) do
    if not named[field] then
      redis.call('HDEL', B, field)
    end
  end
  if #ws > 0 then
    extend(B, ttl + KEY_GRACE_MS)
  end
end

if op == 'take' then
  -- The binding window: the longest wait (never counts as longest; ties: the first).
  local bind, bind_wait, deficit = nil, 0, 0
  for _, w in ipairs(ws) do
    if tokens * w.w > w.level then
      local wait = win_wait(w, tokens, now)
      if not bind or (wait < 0 and bind_wait >= 0) or (wait >= 0 and bind_wait >= 0 and wait > bind_wait) then
        bind, bind_wait, deficit = w, wait, math.max(0, tokens - win_whole(w))
      end
    end
  end
  if bind then
    save_all()
    local wait_ms = nil
    if bind_wait >= 0 then
      wait_ms = bind_wait
    end
    return string.format('{"verdict":"refused","window":"%s","wait_ms":%s,"deficit":%d}',
      bind.name, json_int(wait_ms), deficit)
  end
  for _, w in ipairs(ws) do
    w.level = w.level - tokens * w.w
  end
  save_all()
  return '{"verdict":"taken"}'
elseif op == 'settle' then
  local delta = tokens - charged
  for _, w in ipairs(ws) do
    w.level = math.min(w.level + delta * w.w, w.cap * w.w)
  end
  save_all()
  return '{"verdict":"settled"}'
end
save_all()
local out = {}
for i, w in ipairs(ws) do
  out[i] = string.format('{"available":%d,"capacity":%d,"full_in_ms":%d}', win_whole(w), w.cap, win_full_in(w, now))
end
return '[' .. table.concat(out, ',') .. ']'
