-- Floodgate shared admission state for one pool. All keys share the pool's hash tag, so this
-- runs in one Redis Cluster slot. Time is the server's (TIME), never a gateway's.
-- The key names and what each holds: extproc/schema.py (SCRIPT_KEYS, in this order).
--
-- ARGV: 1 op, 2 lease ttl (ms), 3.. op args. The pool's settings (shares, reservations, picking,
-- queue caps, initial limit) are NOT arguments: they are read from the `settings` hash that the
-- first processor wrote (`configure`), so every grant uses the same ones whoever triggers it.
-- A mutating op on a pool without settings fails with FGNOSETTINGS (the caller configures and
-- retries). Replies are flat lists of alternating names and values (schema.parse_fields).
--
-- Invariants (tests/test_state.py checks them against extproc/permits.py on random histories):
--  * a ticket is in at most one of queue / leases; a lease is created by `acquire` (when
--    grantable), by the grant loop, or by `sync` re-asserting a permit a live request holds;
--    it is removed by `release`, by reclaim (expiry), or by `sync` (its gateway no longer has it);
--  * sum(i0..i2) = ZCARD leases; a grant never takes it above floor(limit) (a lowered limit,
--    or a re-asserted permit, only stops new grants; held permits finish);
--  * each freed permit is granted to exactly one waiter of a live gateway: the loop pops the
--    waiter before leasing it, and `cancel` reports "granted" if the waiter was popped.
--  * reads (`status`, `get_limit`) never write.

if redis.replicate_commands then redis.replicate_commands() end

local K = {}
for i, name in ipairs({'leases', 'lmeta', 'queue', 'qmeta', 'qdl', 'counts', 'state', 'gws', 'active',
                       'epinf', 'lep', 'creditors', 'settings', 'testclock'}) do
  K[name] = KEYS[i]
end
local op = ARGV[1]
local ttl = tonumber(ARGV[2])
local CLASS_SPAN = 4294967296
local RATE_TAU_MS = 10000
local RATE_MIN_EVENTS = 5
local RATE_MIN_AGE_MS = 1000
local WAITER_GRACE_MS = 1000

local now
do
  local fake = redis.call('GET', K.testclock)
  if fake then
    now = tonumber(fake)
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
end

local function num(v, d) if v then return tonumber(v) end return d end

-- A message to one gateway on its channel for this pool (schema.gateway_channel), which shares
-- the pool's hash tag: SPUBLISH keeps it on this shard of a Cluster; a server without sharded
-- pub/sub (Redis 6) gets PUBLISH, and the gateway's SUBSCRIBE fallback matches it.
local function notify(gw, msg)
  local pool = redis.call('HGET', K.settings, 'pool')
  local ch = 'fg:{' .. pool .. '}:gw:' .. gw
  if not pcall(redis.call, 'SPUBLISH', ch, msg) then redis.call('PUBLISH', ch, msg) end
end

local S  -- settings, loaded by load_settings()
local function load_settings()
  local raw = redis.call('HGETALL', K.settings)
  if #raw == 0 then return false end
  local f = {}
  for i = 1, #raw, 2 do f[raw[i]] = raw[i + 1] end
  S = {initial = tonumber(f.initial), picking = f.picking == '1', epoch = tonumber(f.epoch or '0'),
       shares = {}, always = {}, maxq = {}, tcap = {}}
  for k = 1, 3 do
    S.shares[k] = tonumber(f['share' .. (k - 1)])
    S.always[k] = f['always' .. (k - 1)] == '1'
    S.maxq[k] = tonumber(f['maxq' .. (k - 1)])
    S.tcap[k] = tonumber(f['tcap' .. (k - 1)])
  end
  return true
end

-- Exponentially decayed event rates (events per second) in the state hash: `rate` counts freed
-- permits, `g0..g2` grants per class. `<name>_t0` and `<name>_n` let read_rate() correct the
-- start-up bias and say "unknown" (0) until it has seen enough.
local function bump_rate(name)
  local s = redis.call('HMGET', K.state, name, name .. '_ts', name .. '_t0', name .. '_n')
  local rate, ts = num(s[1], 0), num(s[2], now)
  rate = rate * math.exp(-(now - ts) / RATE_TAU_MS) + 1000 / RATE_TAU_MS
  redis.call('HSET', K.state, name, tostring(rate), name .. '_ts', now, name .. '_t0', num(s[3], now),
             name .. '_n', math.min(num(s[4], 0) + 1, 1000000))
end

local function read_rate(name)
  local s = redis.call('HMGET', K.state, name, name .. '_ts', name .. '_t0', name .. '_n')
  local rate, ts, t0, n = num(s[1], 0), num(s[2], now), num(s[3], now), num(s[4], 0)
  if n < RATE_MIN_EVENTS or now - t0 < RATE_MIN_AGE_MS then return 0 end
  local seen = 1 - math.exp(-(now - t0) / RATE_TAU_MS)
  return rate * math.exp(-(now - ts) / RATE_TAU_MS) / seen
end

-- The limit; `write` stores the initial one when the pool has none yet (never on a read).
local function limit_value(write)
  local l = redis.call('HGET', K.state, 'limit')
  if l then return tonumber(l) end
  local initial = (S and S.initial) or 1
  if write then redis.call('HSET', K.state, 'limit', initial, 'version', 0) end
  return initial
end

local function int_limit(write) return math.max(1, math.floor(limit_value(write))) end

local function counts()
  local v = redis.call('HMGET', K.counts, 'i0', 'i1', 'i2', 'q0', 'q1', 'q2')
  return {num(v[1], 0), num(v[2], 0), num(v[3], 0)}, {num(v[4], 0), num(v[5], 0), num(v[6], 0)}
end

-- policy.eligible, mirrored: below the limit any class may take a free permit; a class inside
-- its reservation always may; otherwise what stays free must still cover the unused
-- reservations of the other classes that have waiters (or keep theirs `always`).
local function eligible(c, L, inflight, queued)
  local free = L - inflight[1] - inflight[2] - inflight[3]
  if free < 1 then return false end
  local res = {}
  for k = 1, 3 do res[k] = math.floor(S.shares[k] * L + 1e-9) end
  if inflight[c] < res[c] then return true end
  local others = 0
  for k = 1, 3 do
    if k ~= c and (queued[k] > 0 or S.always[k]) then others = others + math.max(0, res[k] - inflight[k]) end
  end
  return free - 1 >= others
end

local function gateway_alive(gw)
  local exp = redis.call('ZSCORE', K.gws, gw)
  return exp and tonumber(exp) > now  -- dead from the same ms its leases expire
end

-- The least-loaded active endpoint (fewest permits routed to it); ties rotate so that an
-- idle pool still spreads requests. '' when the pool has no active endpoint.
local function pick()
  local eps = redis.call('SMEMBERS', K.active)
  local n = #eps
  if n == 0 then return '' end
  table.sort(eps)
  local start = redis.call('HINCRBY', K.state, 'rr', 1) % n
  local best, best_load = '', math.huge
  for i = 0, n - 1 do
    local ep = eps[(start + i) % n + 1]
    local load = num(redis.call('HGET', K.epinf, ep), 0)
    if load < best_load then best, best_load = ep, load end
  end
  return best
end

-- lmeta = "class|gateway|seq"; qmeta = "class|deadline|gateway|seq|tenant" (tenant last: it
-- may contain '|'). `seq` is the gateway's ticket number, which `sync` compares to its watermark.
local function parse_lmeta(m)
  local c, gw, seq = string.match(m or '', '^(%d)|(.*)|(%d+)$')
  return tonumber(c or '1'), gw or '', tonumber(seq or '0')
end

local function parse_qmeta(m)
  local c, dl, gw, seq, tenant = string.match(m, '^(%d)|([^|]*)|([^|]*)|(%d+)|(.*)$')
  return tonumber(c), tonumber(dl), gw, tonumber(seq), tenant
end

local function put_lease(ticket, c, gw, seq, ep)
  redis.call('ZADD', K.leases, now + ttl, ticket)
  redis.call('HSET', K.lmeta, ticket, c .. '|' .. gw .. '|' .. seq)
  redis.call('HINCRBY', K.counts, 'i' .. c, 1)
  if ep ~= '' then
    redis.call('HSET', K.lep, ticket, ep)
    redis.call('HINCRBY', K.epinf, ep, 1)
  end
end

-- A new grant to class c (1-based): leased, counted as a grant, routed when picking.
local function lease(ticket, c, gw, seq)
  local ep = ''
  if S.picking then ep = pick() end
  put_lease(ticket, c - 1, gw, seq, ep)
  bump_rate('g' .. (c - 1))
  return ep
end

local function unqueue(ticket, meta)
  local c, _, _, _, tenant = parse_qmeta(meta)
  redis.call('ZREM', K.queue, ticket)
  redis.call('ZREM', K.qdl, ticket)
  redis.call('HDEL', K.qmeta, ticket)
  redis.call('HINCRBY', K.counts, 'q' .. c, -1)
  if redis.call('HINCRBY', K.counts, 't' .. c .. ':' .. tenant, -1) <= 0 then
    redis.call('HDEL', K.counts, 't' .. c .. ':' .. tenant)
  end
end

local function put_waiter(ticket, c, deadline, gw, seq, tenant)
  local qseq = redis.call('HINCRBY', K.state, 'seq', 1) % CLASS_SPAN
  redis.call('ZADD', K.queue, c * CLASS_SPAN + qseq, ticket)
  redis.call('ZADD', K.qdl, deadline, ticket)
  redis.call('HSET', K.qmeta, ticket, c .. '|' .. deadline .. '|' .. gw .. '|' .. seq .. '|' .. tenant)
  redis.call('HINCRBY', K.counts, 'q' .. c, 1)
  redis.call('HINCRBY', K.counts, 't' .. c .. ':' .. tenant, 1)
end

-- Time-weighted mean in-flight (decay RATE_TAU_MS) sampled at each release, `lvl` in the state
-- hash: with the release rate it gives the mean hold time (Little), so the policy can tell
-- that a pool which just filled up frees permits faster than its decayed rate says.
local function bump_level()
  local inflight = counts()
  local total = inflight[1] + inflight[2] + inflight[3]
  local s = redis.call('HMGET', K.state, 'lvl', 'lvl_ts')
  local v = total
  if s[2] then
    local w = math.exp(-math.max(0, now - tonumber(s[2])) / RATE_TAU_MS)
    v = num(s[1], total) * w + (1 - w) * total
  end
  redis.call('HSET', K.state, 'lvl', tostring(v), 'lvl_ts', now)
end

local function drop_lease(ticket, count_rate)
  if count_rate and redis.call('ZSCORE', K.leases, ticket) then bump_level() end
  if redis.call('ZREM', K.leases, ticket) == 0 then return false end
  local c = parse_lmeta(redis.call('HGET', K.lmeta, ticket))
  redis.call('HDEL', K.lmeta, ticket)
  redis.call('HINCRBY', K.counts, 'i' .. c, -1)
  local ep = redis.call('HGET', K.lep, ticket)
  if ep then
    redis.call('HDEL', K.lep, ticket)
    if redis.call('HINCRBY', K.epinf, ep, -1) <= 0 then redis.call('HDEL', K.epinf, ep) end
  end
  if count_rate then bump_rate('rate') end
  return true
end

-- Hand free permits to waiters: highest eligible class first, FIFO within it. Each waiter is
-- popped before it is leased, so no permit is ever granted twice. Waiters past their deadline
-- or of a gateway that stopped syncing are dropped, never granted.
local function grant_loop()
  local L = int_limit(true)
  local granted = 0
  for _ = 1, 10000 do
    local inflight, queued = counts()
    if inflight[1] + inflight[2] + inflight[3] >= L then break end
    local progressed = false
    for c = 1, 3 do
      if queued[c] > 0 and eligible(c, L, inflight, queued) then
        local lo = (c - 1) * CLASS_SPAN
        local head = redis.call('ZRANGEBYSCORE', K.queue, lo, '(' .. (lo + CLASS_SPAN), 'LIMIT', 0, 1)[1]
        if not head then
          redis.call('HSET', K.counts, 'q' .. (c - 1), 0)  -- repair a drifted counter
        else
          local meta = redis.call('HGET', K.qmeta, head)
          if not meta then
            redis.call('ZREM', K.queue, head)
          else
            local _, deadline, gw, seq = parse_qmeta(meta)
            unqueue(head, meta)
            if deadline >= now and gateway_alive(gw) then
              local ep = lease(head, c, gw, seq)
              notify(gw, redis.call('HGET', K.settings, 'pool') .. '|' .. head .. '|' .. ep)
              granted = granted + 1
            end
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

-- Expired leases return; waiters past their deadline (plus a grace for the gateway's own
-- cancel) are reaped; a gateway whose liveness expired is dead: its waiters are purged at once
-- (its leases expire on their own TTL, which its last sync set).
local function reclaim()
  local expired = redis.call('ZRANGEBYSCORE', K.leases, '-inf', now, 'LIMIT', 0, 200)
  for _, ticket in ipairs(expired) do drop_lease(ticket, true) end
  local abandoned = redis.call('ZRANGEBYSCORE', K.qdl, '-inf', now - WAITER_GRACE_MS, 'LIMIT', 0, 200)
  for _, ticket in ipairs(abandoned) do
    local meta = redis.call('HGET', K.qmeta, ticket)
    if meta then unqueue(ticket, meta) else redis.call('ZREM', K.qdl, ticket) end
  end
  local dead = redis.call('ZRANGEBYSCORE', K.gws, '-inf', now, 'LIMIT', 0, 20)
  if #dead > 0 then
    local is_dead = {}
    for _, gw in ipairs(dead) do is_dead[gw] = true end
    local all = redis.call('HGETALL', K.qmeta)
    for i = 1, #all, 2 do
      local _, _, gw = parse_qmeta(all[i + 1])
      if is_dead[gw] then unqueue(all[i], all[i + 1]) end
    end
    redis.call('ZREM', K.gws, unpack(dead))
    redis.call('SREM', K.creditors, unpack(dead))
  end
end

-- Tell every gateway holding credits to hand its idle ones back (see `acquire`).
local function recall_credits()
  local pool = redis.call('HGET', K.settings, 'pool')
  for _, creditor in ipairs(redis.call('SMEMBERS', K.creditors)) do
    notify(creditor, pool .. '|!return|')
  end
  redis.call('DEL', K.creditors)
end

-- This gateway's position among the live ones, and how many there are (degraded shares).
local function gateway_rank(gw)
  local live = redis.call('ZRANGEBYSCORE', K.gws, '(' .. now, '+inf')
  table.sort(live)
  for i, g in ipairs(live) do if g == gw then return i - 1, #live end end
  return -1, #live
end

-- Seconds (ms) until the deadline of class c's oldest (`rev` false) or newest waiter; 0 if none.
local function edge_left(c, rev)
  local lo = (c - 1) * CLASS_SPAN
  local t
  if rev then
    t = redis.call('ZREVRANGEBYSCORE', K.queue, '(' .. (lo + CLASS_SPAN), lo, 'LIMIT', 0, 1)[1]
  else
    t = redis.call('ZRANGEBYSCORE', K.queue, lo, '(' .. (lo + CLASS_SPAN), 'LIMIT', 0, 1)[1]
  end
  local meta = t and redis.call('HGET', K.qmeta, t)
  if not meta then return 0 end
  local _, deadline = parse_qmeta(meta)
  return math.max(0, deadline - now)
end

local function snapshot(out, c, tenant, gw)
  local L = int_limit(false)
  local inflight, queued = counts()
  local tq, class_rate = 0, 0
  if c then
    tq = num(redis.call('HGET', K.counts, 't' .. (c - 1) .. ':' .. tenant), 0)
    class_rate = read_rate('g' .. (c - 1))
  end
  local rank, live = -1, redis.call('ZCOUNT', K.gws, '(' .. now, '+inf')
  if gw then rank, live = gateway_rank(gw) end
  for _, v in ipairs({'limit', L, 'i0', inflight[1], 'i1', inflight[2], 'i2', inflight[3],
                      'q0', queued[1], 'q1', queued[2], 'q2', queued[3], 'tenant_queued', tq,
                      'rate', tostring(read_rate('rate')), 'class_rate', tostring(class_rate),
                      'gateways', live, 'rank', rank, 'now', now, 'active', redis.call('SCARD', K.active),
                      'epoch', S and S.epoch or -1}) do
    table.insert(out, v)
  end
  -- For early drop (policy.wait_estimate): how much the rate rests on, the in-flight level it
  -- was measured at, and the head/tail deadlines of each class queue.
  local st = redis.call('HMGET', K.state, 'rate_n', 'lvl')
  for _, v in ipairs({'rate_n', st[1] or '0', 'lvl', st[2] or '0'}) do table.insert(out, v) end
  for k = 1, 3 do
    local h, t = 0, 0
    if queued[k] > 0 then h, t = edge_left(k, false), edge_left(k, true) end
    for _, v in ipairs({'hl' .. (k - 1), h, 'tl' .. (k - 1), t}) do table.insert(out, v) end
  end
  return out
end

if op == 'configure' then
  -- ARGV 3 pool, 4.. field/value pairs of schema.PoolSettings (with `epoch`). Stores them when
  -- the pool has none or these carry a higher epoch; returns what is stored afterwards.
  local mine = {}
  for i = 4, #ARGV, 2 do mine[ARGV[i]] = ARGV[i + 1] end
  local stored = redis.call('HGET', K.settings, 'epoch')
  if not stored or tonumber(mine.epoch) > tonumber(stored) then
    redis.call('DEL', K.settings)
    for i = 4, #ARGV, 2 do redis.call('HSET', K.settings, ARGV[i], ARGV[i + 1]) end
    redis.call('HSET', K.settings, 'pool', ARGV[3])
  end
  return redis.call('HGETALL', K.settings)

elseif op == 'status' then
  -- A read: never reclaims, grants or stores anything. ARGV 3 (optional) gateway for its rank.
  load_settings()
  return snapshot({'granted', '0'}, nil, nil, ARGV[3])

elseif op == 'get_limit' then
  load_settings()
  local s = redis.call('HMGET', K.state, 'limit', 'rtt_noload', 'probe_count', 'probe_jitter', 'version', 'vegas_x')
  return {'limit', s[1] or tostring(limit_value(false)), 'rtt_noload', s[2] or '0', 'probe_count', s[3] or '0',
          'probe_jitter', s[4] or '1', 'version', s[5] or '0', 'extra', s[6] or ''}
end

if not load_settings() then return redis.error_reply('FGNOSETTINGS pool settings missing') end

if op == 'acquire' then
  -- ARGV 3 ticket, 4 gateway, 5 seq, 6 class, 7 tenant, 8 credits wanted: lease now if the
  -- grant loop would. The hot path: a short reply {granted=g, endpoint, credits} on a grant,
  -- the full snapshot only when the policy has to decide. Idempotent: a retried acquire of a
  -- ticket already leased returns that lease.
  --
  -- Credits: while nothing waits and the pool is at most half full, a grant may come with up
  -- to `wanted` extra leases the gateway admits later requests with, without a round trip.
  -- They are ordinary leases (counted in-flight, renewed, reclaimed), so in-flight never
  -- exceeds the limit; `enqueue` tells every creditor to return its idle ones.
  local ticket, gw, seq, c, tenant = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]) + 1, ARGV[7]
  if redis.call('ZSCORE', K.leases, ticket) then
    return {'granted', 'g', 'endpoint', redis.call('HGET', K.lep, ticket) or '', 'credits', ''}
  end
  reclaim()
  grant_loop()
  local L = int_limit(true)
  local inflight, queued = counts()
  local ok = eligible(c, L, inflight, queued)
  if ok then
    for k = 1, c do
      if queued[k] > 0 and eligible(k, L, inflight, queued) then ok = false end
    end
  end
  if ok then
    local ep = lease(ticket, c, gw, seq)
    local credits = {}
    local wanted = tonumber(ARGV[8] or '0') or 0
    if wanted > 0 and not S.picking and queued[1] + queued[2] + queued[3] == 0 then
      local n = math.min(wanted, math.floor(L / 2) - (inflight[1] + inflight[2] + inflight[3] + 1))
      for i = 1, n do
        local credit = ticket .. ':c' .. i
        put_lease(credit, 1, gw, seq, '')
        table.insert(credits, credit)
      end
      if n > 0 then redis.call('SADD', K.creditors, gw) end
    end
    return {'granted', 'g', 'endpoint', ep, 'credits', table.concat(credits, ',')}
  end
  recall_credits()  -- a request could not be admitted: idle credits elsewhere must come back
  return snapshot({'granted', '0'}, c, tenant, nil)

elseif op == 'enqueue' then
  -- ARGV 3 ticket, 4 gateway, 5 seq, 6 class, 7 tenant, 8 timeout (ms). The class's
  -- max_queue and the tenant cap are checked here, atomically (`rejected`). Idempotent: a
  -- ticket already queued or leased is not added again.
  local ticket, gw, seq, c, tenant = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]) + 1, ARGV[7]
  local deadline = now + tonumber(ARGV[8])
  reclaim()
  if redis.call('ZSCORE', K.leases, ticket) then
    return snapshot({'granted', '1', 'endpoint', redis.call('HGET', K.lep, ticket) or ''}, c, tenant, nil)
  end
  if redis.call('HEXISTS', K.qmeta, ticket) == 0 then
    local _, queued = counts()
    local tq = num(redis.call('HGET', K.counts, 't' .. (c - 1) .. ':' .. tenant), 0)
    local why = nil
    if queued[c] >= S.maxq[c] then why = 'queue_full' elseif tenant ~= '' and tq >= S.tcap[c] then why = 'tenant_cap' end
    if why then return snapshot({'granted', '0', 'rejected', why}, c, tenant, nil) end
    -- A gateway that has not synced yet (first call after a Redis restart) is registered; a
    -- registered one is not refreshed here: only `sync` proves a gateway alive.
    redis.call('ZADD', K.gws, 'NX', now + ttl, gw)
    put_waiter(ticket, c - 1, deadline, gw, seq, tenant)
  end
  recall_credits()
  grant_loop()
  local mine = redis.call('ZSCORE', K.leases, ticket) and '1' or '0'
  return snapshot({'granted', mine, 'endpoint', redis.call('HGET', K.lep, ticket) or ''}, c, tenant, nil)

elseif op == 'cancel' then
  -- ARGV 3 ticket. 0 = was queued, now removed; 1 = already granted (caller owns a permit);
  -- 2 = neither (its lease was reclaimed, or it was reaped).
  local ticket = ARGV[3]
  local meta = redis.call('HGET', K.qmeta, ticket)
  if meta then unqueue(ticket, meta) return 0 end
  if redis.call('ZSCORE', K.leases, ticket) then return 1 end
  return 2

elseif op == 'release' then
  -- ARGV 3.. tickets. Returns how many were held (a missing one was reclaimed already).
  local released = 0
  for i = 3, #ARGV do
    if drop_lease(ARGV[i], true) then released = released + 1 end
  end
  reclaim()
  grant_loop()
  return released

elseif op == 'return_credits' then
  -- ARGV 3.. idle credit tickets handed back unused: not completions, so no rate event.
  for i = 3, #ARGV do drop_lease(ARGV[i], false) end
  grant_loop()
  return 0

elseif op == 'sync' then
  -- The gateway re-asserts everything it has: ARGV 3 gateway, 4 watermark (its next ticket
  -- number), 5 number of held entries, then held "ticket|class|seq|endpoint", then waiting
  -- "ticket|class|seq|remaining_ms|tenant". Afterwards Redis holds exactly that for this
  -- gateway: held leases are extended (re-created if Redis lost them: the requests are live),
  -- waiters missing from the queue are put back, and this gateway's leases and waiters that it
  -- did not assert and that are older than the watermark (abandoned calls that ran late, or
  -- leftovers of an outage) are dropped. Proves the gateway alive for one TTL.
  local gw, watermark, nheld = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  redis.call('ZADD', K.gws, now + ttl, gw)
  local held, waiting = {}, {}
  local reasserted, requeued, dropped = 0, 0, 0
  for i = 6, 5 + nheld do
    local t, c, seq, ep = string.match(ARGV[i], '^([^|]*)|(%d)|(%d+)|(.*)$')
    held[t] = true
    if redis.call('ZADD', K.leases, 'XX', 'CH', now + ttl, t) == 0 and not redis.call('ZSCORE', K.leases, t) then
      local meta = redis.call('HGET', K.qmeta, t)
      if meta then unqueue(t, meta) end
      put_lease(t, tonumber(c), gw, seq, ep)
      reasserted = reasserted + 1
    end
  end
  for i = 6 + nheld, #ARGV do
    local t, c, seq, remaining, tenant = string.match(ARGV[i], '^([^|]*)|(%d)|(%d+)|(%d+)|(.*)$')
    waiting[t] = true
    if not redis.call('ZSCORE', K.leases, t) and redis.call('HEXISTS', K.qmeta, t) == 0 then
      put_waiter(t, tonumber(c), now + tonumber(remaining), gw, seq, tenant)
      requeued = requeued + 1
    end
  end
  local all = redis.call('HGETALL', K.lmeta)
  for i = 1, #all, 2 do
    local t = all[i]
    local _, lgw, seq = parse_lmeta(all[i + 1])
    if lgw == gw and seq < watermark and not held[t] and not waiting[t] then
      drop_lease(t, false)
      dropped = dropped + 1
    end
  end
  all = redis.call('HGETALL', K.qmeta)
  for i = 1, #all, 2 do
    local t = all[i]
    local _, _, qgw, seq = parse_qmeta(all[i + 1])
    if qgw == gw and seq < watermark and not waiting[t] then
      unqueue(t, all[i + 1])
      dropped = dropped + 1
    end
  end
  reclaim()
  grant_loop()
  return snapshot({'granted', '0', 'reasserted', reasserted, 'requeued', requeued, 'dropped', dropped},
                  nil, nil, gw)

elseif op == 'mine' then
  -- ARGV 3.. tickets a gateway is waiting on: the poll fallback for lost grant messages.
  reclaim()
  grant_loop()
  local leased = {}
  for i = 3, #ARGV do
    if redis.call('ZSCORE', K.leases, ARGV[i]) then
      table.insert(leased, ARGV[i])
      table.insert(leased, redis.call('HGET', K.lep, ARGV[i]) or '')
    end
  end
  return leased

elseif op == 'set_limit' then
  -- ARGV 3 expected version, 4 limit, 5 rtt_noload, 6 probe_count, 7 probe_jitter, 8 the rest
  -- of the limiter state (opaque here: vegas.py's baseline bookkeeping).
  -- Compare-and-set: the Vegas arithmetic stays in Python (vegas.py), atomic here.
  limit_value(true)
  local version = num(redis.call('HGET', K.state, 'version'), 0)
  if version ~= tonumber(ARGV[3]) then return {'ok', '0', 'version', tostring(version)} end
  redis.call('HSET', K.state, 'limit', ARGV[4], 'rtt_noload', ARGV[5], 'probe_count', ARGV[6],
             'probe_jitter', ARGV[7], 'vegas_x', ARGV[8] or '', 'version', version + 1)
  grant_loop()
  return {'ok', '1', 'version', tostring(version + 1)}
end
return redis.error_reply('unknown op ' .. tostring(op))
