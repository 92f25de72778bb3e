-- Floodgate shared admission state for one pool. All keys share the pool's hash tag, so this
-- runs in one Redis Cluster slot. Time is the server's (TIME), never a gateway's.
--
-- KEYS: 1 leases  ZSET ticket -> lease expiry (ms)
--       2 lmeta   HASH ticket -> class of the lease
--       3 queue   ZSET ticket -> class * 2^32 + seq  (strict priority, FIFO within a class)
--       4 qmeta   HASH ticket -> "class|deadline_ms|gateway|tenant"
--       5 qdl     ZSET ticket -> deadline (ms), to reap abandoned waiters
--       6 counts  HASH i0..i2 in-flight, q0..q2 queued, t<class>:<tenant> queued per tenant
--       7 state   HASH limit, rtt_noload, probe_count, probe_jitter, version, seq, event rates
--       8 gws     ZSET gateway -> liveness expiry (ms)
--       9 active  SET  endpoints that may receive new requests (the registry's active ones)
--      10 epinf   HASH endpoint -> permits held by requests routed to it
--      11 lep     HASH ticket -> endpoint it was routed to
--      12 creditors SET gateways holding local credits (told to return them when a queue forms)
-- ARGV: 1 op, 2 lease ttl (ms), 3 initial limit, 4..6 class shares (negative: the
--       reservation is kept even without waiters), 7 pool name,
--       8 endpoint picking (1/0), 9.. op args
--
-- Invariants (tests/test_state_invariants.py checks them):
--  * a ticket is in at most one of queue / leases; a lease is created only by `acquire`
--    (when grantable) or by the grant loop, and removed only by `release` or reclaim;
--  * sum(i0..i2) = ZCARD leases <= floor(limit) after every grant (a lowered limit only
--    stops new grants; held permits finish);
--  * each freed permit is granted to exactly one waiter: the loop pops the waiter before
--    leasing it, and `cancel` reports "granted" if the waiter was popped, so the gateway
--    that owns it must use or release it.

if redis.replicate_commands then redis.replicate_commands() end

local K_LEASES, K_LMETA, K_QUEUE, K_QMETA, K_QDL, K_COUNTS, K_STATE, K_GWS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_ACTIVE, K_EPINF, K_LEP, K_CREDITORS = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local op = ARGV[1]
local ttl = tonumber(ARGV[2])
local initial = tonumber(ARGV[3])
local shares, always = {}, {}
for k = 1, 3 do
  local s = tonumber(ARGV[3 + k])
  shares[k], always[k] = math.abs(s), s < 0
end
local pool = ARGV[7]
local picking = ARGV[8] == '1'
local CLASS_SPAN = 4294967296
local RATE_TAU_MS = 10000
local RATE_MIN_EVENTS = 5
local RATE_MIN_AGE_MS = 1000
local WAITER_GRACE_MS = 1000

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function num(v, d) if v then return tonumber(v) end return d end

-- Exponentially decayed event rates (events per second) in the state hash: `rate` counts freed
-- permits, `g0..g2` grants per class. `<name>_t0` and `<name>_n` let read_rate() correct the
-- start-up bias and say "unknown" (0) until it has seen enough.
local function bump_rate(name)
  local s = redis.call('HMGET', K_STATE, name, name .. '_ts', name .. '_t0', name .. '_n')
  local rate, ts = num(s[1], 0), num(s[2], now)
  rate = rate * math.exp(-(now - ts) / RATE_TAU_MS) + 1000 / RATE_TAU_MS
  redis.call('HSET', K_STATE, name, tostring(rate), name .. '_ts', now, name .. '_t0', num(s[3], now),
             name .. '_n', math.min(num(s[4], 0) + 1, 1000000))
end

local function read_rate(name)
  local s = redis.call('HMGET', K_STATE, name, name .. '_ts', name .. '_t0', name .. '_n')
  local rate, ts, t0, n = num(s[1], 0), num(s[2], now), num(s[3], now), num(s[4], 0)
  if n < RATE_MIN_EVENTS or now - t0 < RATE_MIN_AGE_MS then return 0 end
  local seen = 1 - math.exp(-(now - t0) / RATE_TAU_MS)
  return rate * math.exp(-(now - ts) / RATE_TAU_MS) / seen
end

local function limit_value()
  local l = redis.call('HGET', K_STATE, 'limit')
  if not l then
    redis.call('HSET', K_STATE, 'limit', initial, 'version', 0)
    return initial
  end
  return tonumber(l)
end

local function counts()
  local v = redis.call('HMGET', K_COUNTS, 'i0', 'i1', 'i2', 'q0', 'q1', 'q2')
  return {num(v[1], 0), num(v[2], 0), num(v[3], 0)}, {num(v[4], 0), num(v[5], 0), num(v[6], 0)}
end

-- policy.eligible, mirrored: below the limit any class may take a free permit; a class inside
-- its reservation always may; otherwise what stays free must still cover the unused
-- reservations of the other classes that have waiters (or keep theirs `always`).
local function eligible(c, L, inflight, queued)
  local free = L - inflight[1] - inflight[2] - inflight[3]
  if free < 1 then return false end
  local res = {}
  for k = 1, 3 do res[k] = math.floor(shares[k] * L + 1e-9) end
  if inflight[c] < res[c] then return true end
  local others = 0
  for k = 1, 3 do
    if k ~= c and (queued[k] > 0 or always[k]) then others = others + math.max(0, res[k] - inflight[k]) end
  end
  return free - 1 >= others
end

local function gateway_alive(gw)
  local exp = redis.call('ZSCORE', K_GWS, gw)
  return exp and tonumber(exp) >= now
end

-- The least-loaded active endpoint (fewest permits routed to it); ties rotate so that an
-- idle pool still spreads requests. '' when the pool has no active endpoint.
local function pick()
  local eps = redis.call('SMEMBERS', K_ACTIVE)
  local n = #eps
  if n == 0 then return '' end
  table.sort(eps)
  local start = redis.call('HINCRBY', K_STATE, 'rr', 1) % n
  local best, best_load = '', math.huge
  for i = 0, n - 1 do
    local ep = eps[(start + i) % n + 1]
    local load = num(redis.call('HGET', K_EPINF, ep), 0)
    if load < best_load then best, best_load = ep, load end
  end
  return best
end

local function lease(ticket, c)
  redis.call('ZADD', K_LEASES, now + ttl, ticket)
  redis.call('HSET', K_LMETA, ticket, c - 1)
  redis.call('HINCRBY', K_COUNTS, 'i' .. (c - 1), 1)
  bump_rate('g' .. (c - 1))
  if picking then
    local ep = pick()
    if ep ~= '' then
      redis.call('HSET', K_LEP, ticket, ep)
      redis.call('HINCRBY', K_EPINF, ep, 1)
    end
    return ep
  end
  return ''
end

local function unqueue(ticket, meta)
  -- meta = "class|deadline|gateway|tenant"
  local c, rest = string.match(meta, '^(%d)|(.*)$')
  local tenant = string.match(rest, '^[^|]*|[^|]*|(.*)$')
  redis.call('ZREM', K_QUEUE, ticket)
  redis.call('ZREM', K_QDL, ticket)
  redis.call('HDEL', K_QMETA, ticket)
  redis.call('HINCRBY', K_COUNTS, 'q' .. c, -1)
  if redis.call('HINCRBY', K_COUNTS, 't' .. c .. ':' .. tenant, -1) <= 0 then
    redis.call('HDEL', K_COUNTS, 't' .. c .. ':' .. tenant)
  end
end

local function drop_lease(ticket, count_rate)
  if redis.call('ZREM', K_LEASES, ticket) == 0 then return false end
  local c = redis.call('HGET', K_LMETA, ticket) or '1'
  redis.call('HDEL', K_LMETA, ticket)
  redis.call('HINCRBY', K_COUNTS, 'i' .. c, -1)
  local ep = redis.call('HGET', K_LEP, ticket)
  if ep then
    redis.call('HDEL', K_LEP, ticket)
    if redis.call('HINCRBY', K_EPINF, ep, -1) <= 0 then redis.call('HDEL', K_EPINF, ep) end
  end
  if count_rate then bump_rate('rate') end
  return true
end

-- Hand free permits to waiters: highest eligible class first, FIFO within it. Each waiter is
-- popped before it is leased, so no permit is ever granted twice.
local function grant_loop()
  local L = math.max(1, math.floor(limit_value()))
  local granted = 0
  for _ = 1, 10000 do
    local inflight, queued = counts()
    if inflight[1] + inflight[2] + inflight[3] >= L then break end
    local progressed = false
    for c = 1, 3 do
      if queued[c] > 0 and eligible(c, L, inflight, queued) then
        local lo = (c - 1) * CLASS_SPAN
        local head = redis.call('ZRANGEBYSCORE', K_QUEUE, lo, '(' .. (lo + CLASS_SPAN), 'LIMIT', 0, 1)[1]
        if not head then
          redis.call('HSET', K_COUNTS, 'q' .. (c - 1), 0)  -- repair a drifted counter
        else
          local meta = redis.call('HGET', K_QMETA, head) or ((c - 1) .. '|0||')
          local deadline, gw = string.match(meta, '^%d|([^|]*)|([^|]*)|')
          unqueue(head, meta)
          if tonumber(deadline) >= now and gateway_alive(gw) then
            local ep = lease(head, c)
            redis.call('PUBLISH', 'fg:gw:' .. gw, pool .. '|' .. head .. '|' .. ep)
            granted = granted + 1
          end
        end
        progressed = true
        break
      end
    end
    if not progressed then break end
  end
  return granted
end

local function reclaim()
  local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, 200)
  for _, ticket in ipairs(expired) do drop_lease(ticket, true) end
  local abandoned = redis.call('ZRANGEBYSCORE', K_QDL, '-inf', now - WAITER_GRACE_MS, 'LIMIT', 0, 200)
  for _, ticket in ipairs(abandoned) do
    local meta = redis.call('HGET', K_QMETA, ticket)
    if meta then unqueue(ticket, meta) else redis.call('ZREM', K_QDL, ticket) end
  end
  redis.call('ZREMRANGEBYSCORE', K_GWS, '-inf', now - 60000)
  return #expired
end

-- Tell every gateway holding credits to hand its idle ones back (see `acquire`).
local function recall_credits()
  for _, creditor in ipairs(redis.call('SMEMBERS', K_CREDITORS)) do
    redis.call('PUBLISH', 'fg:gw:' .. creditor, pool .. '|!return|')
  end
  redis.call('DEL', K_CREDITORS)
end

local function touch_gateway(gw)
  redis.call('ZADD', K_GWS, now + ttl, gw)
end

-- {granted(0/1), limit, i0, i1, i2, q0, q1, q2, tenant_queued, rate, live_gateways, now,
--  endpoint the granted ticket was routed to ('' if none), active endpoints, grant rate of
--  the request's class}
local function snapshot(granted, c, tenant, ep)
  local L = math.max(1, math.floor(limit_value()))
  local inflight, queued = counts()
  local tq, class_rate = 0, 0
  if c then
    tq = num(redis.call('HGET', K_COUNTS, 't' .. (c - 1) .. ':' .. tenant), 0)
    class_rate = read_rate('g' .. (c - 1))
  end
  return {granted, L, inflight[1], inflight[2], inflight[3], queued[1], queued[2], queued[3], tq,
          tostring(read_rate('rate')), redis.call('ZCOUNT', K_GWS, now, '+inf'), now, ep or '',
          redis.call('SCARD', K_ACTIVE), tostring(class_rate)}
end

if op == 'acquire' then
  -- ARGV 9 ticket, 10 gateway, 11 class, 12 tenant, 13 credits wanted: lease now if the grant
  -- loop would. The hot path: no gateway touch (the renewal loop keeps gateways alive) and a
  -- short reply {'g', endpoint, credit tickets...} on a grant; the full snapshot only when the
  -- policy has to decide.
  --
  -- Credits: while nothing waits and the pool is at most half full, a grant may come with up
  -- to `wanted` extra leases the gateway admits later requests with, without a round trip.
  -- They are ordinary leases (counted in-flight, renewed, reclaimed), so in-flight never
  -- exceeds the limit; `enqueue` tells every creditor to return its idle ones.
  local ticket, gw, c, tenant = ARGV[9], ARGV[10], tonumber(ARGV[11]) + 1, ARGV[12]
  reclaim()
  grant_loop()
  local L = math.max(1, math.floor(limit_value()))
  local inflight, queued = counts()
  local ok = eligible(c, L, inflight, queued)
  if ok then
    for k = 1, c do
      if queued[k] > 0 and eligible(k, L, inflight, queued) then ok = false end
    end
  end
  if ok then
    local reply = {'g', lease(ticket, c)}
    local wanted = tonumber(ARGV[13] or '0') or 0
    if wanted > 0 and not picking and queued[1] + queued[2] + queued[3] == 0 then
      local n = math.min(wanted, math.floor(L / 2) - (inflight[1] + inflight[2] + inflight[3] + 1))
      for i = 1, n do
        local credit = ticket .. ':c' .. i
        redis.call('ZADD', K_LEASES, now + ttl, credit)
        redis.call('HSET', K_LMETA, credit, 1)
        redis.call('HINCRBY', K_COUNTS, 'i1', 1)
        table.insert(reply, credit)
      end
      if n > 0 then redis.call('SADD', K_CREDITORS, gw) end
    end
    return reply
  end
  recall_credits()  -- a request could not be admitted: idle credits elsewhere must come back
  touch_gateway(gw)
  return snapshot(0, c, tenant)

elseif op == 'enqueue' then
  -- ARGV 9 ticket, 10 gateway, 11 class, 12 tenant, 13 timeout (ms)
  local ticket, gw, c, tenant = ARGV[9], ARGV[10], tonumber(ARGV[11]) + 1, ARGV[12]
  local deadline = now + tonumber(ARGV[13])
  reclaim()
  touch_gateway(gw)
  local seq = redis.call('HINCRBY', K_STATE, 'seq', 1) % CLASS_SPAN
  redis.call('ZADD', K_QUEUE, (c - 1) * CLASS_SPAN + seq, ticket)
  redis.call('ZADD', K_QDL, deadline, ticket)
  redis.call('HSET', K_QMETA, ticket, (c - 1) .. '|' .. deadline .. '|' .. gw .. '|' .. tenant)
  redis.call('HINCRBY', K_COUNTS, 'q' .. (c - 1), 1)
  redis.call('HINCRBY', K_COUNTS, 't' .. (c - 1) .. ':' .. tenant, 1)
  recall_credits()
  grant_loop()
  local mine = redis.call('ZSCORE', K_LEASES, ticket) and 1 or 0
  return snapshot(mine, c, tenant, redis.call('HGET', K_LEP, ticket))

elseif op == 'cancel' then
  -- ARGV 9 ticket. 0 = was queued, now removed; 1 = already granted (caller owns a permit);
  -- 2 = neither (its lease was reclaimed, or it was reaped).
  local ticket = ARGV[9]
  local meta = redis.call('HGET', K_QMETA, ticket)
  if meta then unqueue(ticket, meta) return 0 end
  if redis.call('ZSCORE', K_LEASES, ticket) then return 1 end
  return 2

elseif op == 'release' then
  -- ARGV 9.. tickets. Returns how many were held (a missing one was reclaimed already).
  local released = 0
  for i = 9, #ARGV do
    if drop_lease(ARGV[i], true) then released = released + 1 end
  end
  reclaim()
  grant_loop()
  return released

elseif op == 'return_credits' then
  -- ARGV 9.. idle credit tickets handed back unused: not completions, so no rate event.
  for i = 9, #ARGV do drop_lease(ARGV[i], false) end
  grant_loop()
  return 0

elseif op == 'renew' then
  -- ARGV 9 gateway, 10.. tickets. Extends every lease still held; returns the ones lost.
  touch_gateway(ARGV[9])
  local lost = {}
  for i = 10, #ARGV do
    if redis.call('ZADD', K_LEASES, 'XX', 'CH', now + ttl, ARGV[i]) == 0 and
       not redis.call('ZSCORE', K_LEASES, ARGV[i]) then
      table.insert(lost, ARGV[i])
    end
  end
  reclaim()
  grant_loop()
  return lost

elseif op == 'mine' then
  -- ARGV 9.. tickets a gateway is waiting on: the poll fallback for lost grant messages.
  reclaim()
  grant_loop()
  local leased = {}
  for i = 9, #ARGV do
    if redis.call('ZSCORE', K_LEASES, ARGV[i]) then
      table.insert(leased, ARGV[i])
      table.insert(leased, redis.call('HGET', K_LEP, ARGV[i]) or '')
    end
  end
  return leased

elseif op == 'status' then
  reclaim()
  grant_loop()
  return snapshot(0, nil, nil)

elseif op == 'get_limit' then
  limit_value()
  local s = redis.call('HMGET', K_STATE, 'limit', 'rtt_noload', 'probe_count', 'probe_jitter', 'version')
  return {s[1], s[2] or '0', s[3] or '0', s[4] or '1', s[5] or '0'}

elseif op == 'set_limit' then
  -- ARGV 9 expected version, 10 limit, 11 rtt_noload, 12 probe_count, 13 probe_jitter.
  -- Compare-and-set: the Vegas arithmetic stays in Python (vegas.py), atomic here.
  limit_value()
  local version = num(redis.call('HGET', K_STATE, 'version'), 0)
  if version ~= tonumber(ARGV[9]) then return {0, tostring(version)} end
  redis.call('HSET', K_STATE, 'limit', ARGV[10], 'rtt_noload', ARGV[11], 'probe_count', ARGV[12],
             'probe_jitter', ARGV[13], 'version', version + 1)
  grant_loop()
  return {1, tostring(version + 1)}
end
return redis.error_reply('unknown op ' .. tostring(op))
