-- tokengate ledger: the test clock. Appended to the prelude only by RedisLedger::connect_with_clock
-- (tests; production never builds it): the time, in milliseconds, arrives as the last argument of
-- every call instead of being read from Redis TIME, and now_ms() takes it off ARGV, so it must be
-- the first thing a script calls.
local function now_ms()
  return tonumber(table.remove(ARGV))
end
