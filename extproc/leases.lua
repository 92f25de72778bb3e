-- Floodgate shared admission state for one pool. All keys share the pool's hash tag, so this
-- runs in one Redis Cluster slot. Time is the server's (TIME), never a gateway's.
-- The key names and what each holds: extproc/schema.py (SCRIPT_KEYS, in this order).
--
-- Loaded as a Redis Function library (FUNCTION LOAD, called with FCALL): this file defines
-- `main(keys, args)` and state.py appends the registration, or, on a server without Functions
-- (Redis 6), `return main(KEYS, ARGV)` to run it as an EVALSHA script. As a library the helper
-- functions below are built once at load time, not on every call; per-call state lives in the
-- upvalues that `main` resets first (Redis runs one call at a time).
--
-- ARGV: 1 op, 2 lease ttl (ms), 3.. op args. The pool's settings (shares, reservations, picking,
-- queue caps, initial limit) are NOT arguments: they are read from the `settings` hash that the
-- first processor wrote (`configure`), so every grant uses the same ones whoever triggers it.
-- A mutating op on a pool without settings fails with FGNOSETTINGS (the caller configures and
-- retries). Replies are flat lists of alternating names and values (schema.parse_fields).
--
-- Cost: each hash the hot path needs (settings, counts, state) is read once per call into a
-- Lua table and the changed fields of counts and state are written back once at the end
-- (`flush`), so a call runs few commands. A processor sends its admission ops as `batch`
-- calls (several ops, one call): everything read or memoised per call (the hashes, the event
-- rates, the snapshot's queue edges, live gateways) is then shared by the batch's ops, and
-- stays correct between them (each op that changes what a memo holds updates or drops it).
--
-- Invariants (tests/test_state.py checks them against extproc/permits.py on random histories):
--  * a ticket is in at most one of queue / leases; a lease is created by `acquire`/`admit`
--    (when grantable), by the grant loop, or by `sync` re-asserting a permit a live request
--    holds; it is removed by `release`, by reclaim (expiry), or by `sync` (its gateway no longer has it);
--  * sum(i0..i2) = ZCARD leases; a grant never takes it above floor(limit) (a lowered limit,
--    or a re-asserted permit, only stops new grants; held permits finish);
--  * each freed permit is granted to exactly one waiter of a live gateway: the loop pops the
--    waiter before leasing it, and `cancel` reports "granted" if the waiter was popped.
--  * reads (`status`, `get_limit`) never write.

local KEY_NAMES = {'leases', 'lmeta', 'queue', 'qmeta', 'qdl', 'counts', 'state', 'gws', 'active',
                   'epinf', 'lep', 'creditors', 'epfill', 'settings', 'admin_testclock', 'qsize'}
local CLASS_SPAN = 4294967296
local RATE_TAU_MS = 10000
local RATE_MIN_EVENTS = 5
local RATE_MIN_AGE_MS = 1000
local WAITER_GRACE_MS = 1000
-- n: waiters with a tenant, nf: tenants with waiters (per class)
local COUNT_FIELDS = {'i0', 'i1', 'i2', 'q0', 'q1', 'q2', 'n0', 'n1', 'n2', 'nf0', 'nf1', 'nf2'}
-- A field whose value is longer than `hash-max-listpack-value` (64 by default) makes the server
-- keep a hash as a hashtable for good (it never converts back while the key exists). `sync`
-- writes it into the per-ticket hashes (lmeta, qmeta) and the state hash: as listpacks (the
-- default up to 512 fields in Valkey 9) every HSET / HGET / HGETDEL of a ticket scans the whole
-- hash, so a decision cost grew with the queue and the number of gateways (the state hash
-- holds one `hw:` field per gateway). Readers of those hashes skip PAD_FIELD.
local PAD_FIELD = '~'
local PAD = '~hashtable~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~'
-- ZSETs likewise: up to `zset-max-listpack-entries` (128 by default) the server keeps a ZSET as
-- a listpack, where every ZADD / ZREM / ZSCORE scans it and a ZADD reallocates it: the `leases`
-- of a pool of 128 permits cost ~8 % of a contended decision's instructions that way. A member
-- longer than `zset-max-listpack-value` converts it to a skiplist, and a ZSET never converts
-- back while it exists, so `sync` adds PAD and removes it at once (no reader ever sees it) in
-- the leases, queue and qdl of this size or more. An emptied ZSET is deleted and starts as a
-- listpack again, until the next sync.
local ZSET_PAD_MIN = 16
-- Strings built once (number to string conversion costs more than the commands it feeds).
local CLS = {'0', '1', '2'}            -- stored class of 1-based c
local CLASS0 = {['0'] = 0, ['1'] = 1, ['2'] = 2}  -- stored class -> 0-based number (tonumber: two strtod)
local GRATE = {'g0:p', 'g1:p', 'g2:p'}  -- per-class grant-rate field of 1-based c
local CLASS_LO = {'0', '4294967296', '8589934592'}                 -- queue score range of c
local CLASS_HI = {'(4294967296', '(8589934592', '(12884901888'}    -- (exclusive)
-- The state hash fields every mutating call may need, read with one HMGET. Each event rate is
-- one field "rate|ts|t0|n" and the level one field "level|ts" (`:p`, packed: fewer fields to
-- read, look up and write back). The Vegas fields (rtt_noload, probe_count, probe_jitter,
-- vegas_x) are read only by get_limit.
local STATE_FIELDS = {'limit', 'version', 'seq', 'rr', 'due', 'lvl:p', 'rate:p', 'g0:p', 'g1:p', 'g2:p', 'ramp:p',
                      'ramp:x', 'ej', 'fq', 'hold'}
-- A waiter's place within its class: ties of the fair order's tags go by arrival, the
-- queue sequence modulo this as the score's fraction (exact in a double: scores < 2^34).
local TIE_SPAN = 65536
-- Ejected endpoints (`eject`) kept in the state field `ej`: at most this many, the latest-ending.
local EJECT_MAX = 64

-- Parsed settings kept between calls (a library's upvalues live until it is reloaded), per
-- settings key, checked against the `stamp` that `configure` writes with each new version.
local SCACHE = {}

-- Per-call state, reset by main().
local K = {}        -- key name -> key
local ttl, now
local NOW_S, NOW_EXCL_S, EXPIRY_S  -- now, '(' .. now, now + ttl as strings
local DUE           -- when reclaim next has work (state `due`), nil = unknown
local S             -- settings (load_settings), false when the pool has none
local ST, ST_DIRTY  -- state hash fields (strings as stored), and the ones to write back
local INF, QUE, CNT_DIRTY  -- in-flight and queued per class (1-based), from the counts hash
local INF0, QUE0           -- as read (flush writes only what changed)
local NQ, NQ0              -- waiters with a tenant per class (1-based), as now and as read
local NF, NF0              -- tenants with waiters per class (1-based), as now and as read
local FQ, FQ_DIRTY         -- the fair order (fair()): {v, a, t} per class, and whether to write it back
local ALIVE         -- gateway -> alive, memo for this call
local LIVE_UNTIL    -- gateway -> when its liveness ends (ms), where ALIVE was read or set
local REG           -- gateway -> true: in `gws` (alive or not), memo for this call (reclaim's purge drops it)
local EDGE          -- class (1-based) -> {head deadline, tail deadline} (false: empty), memo for this call
local LIVE, NACTIVE -- live gateway count, active endpoint count: memo for this call
local RT            -- event rate name -> {rate, ts, t0, n}, parsed once per call (flush writes it back)
local LVL_DONE      -- the level was sampled in this call (again at the same `now` it would not change)
local NO_CREDITORS  -- no gateway holds credits (checked, or recalled, in this call)
local HAS_LEP       -- some lease has a routed endpoint (lep exists), memo for this call
local MY_GW, MINE   -- `batch`: the calling gateway, and its grants (ticket, endpoint) for the reply
local HEARS         -- gateway -> its grant channel has a subscriber, memo for this call
local CALLER        -- `sync`: the calling gateway (alive: it called; its waiters are granted)
local CALL_SNAP     -- `batch`: this call's reply carries a whole snapshot (later ones send only their own part)
local RAMP          -- the onset ramp's bucket {tokens, ts} once brought to `now` in this call (nil: not yet)
local RAMPX         -- new endpoints' ramp credit {tokens, until_ms} read in this call (false: none; nil: not yet)
local PF            -- prefill estimates {eps = active endpoints sorted, lv = endpoint -> level now} (nil: not read)
-- Numbers parsed once per call (tonumber of a string runs strtod twice; these were read per op):
local LIM, ILIM     -- the limit as stored, and int_limit's; nil = not read yet (set_state('limit') drops them)
local QSEQ          -- the queue sequence (state `seq`) as a number, written back by flush
local RES, RES_L    -- eligible(): reservations and higher-class headroom at limit RES_L
local RRATE         -- read_rate() results of this call by rate name (bump_rate drops one)
local LVL_S         -- the level as the snapshot reports it (nil: not yet; bump_level drops it)
local HOLD          -- the hold after lost writes (held()): {until_ms, start_ms, listed, waited for}, false: none, nil: not read

-- The standard functions the hot path uses, as upvalues bound by main() on each call: a library
-- reaches a global through its environment's fallback (they are not reachable at load time), a
-- few % of a decision's instructions. (`redis` stays global: the registration line needs it.)
local tonumber, tostring, string, table, math, pcall, unpack, ipairs, pairs, next, type

-- (a value that is not a number, written by something else, is none: `d`)
local function num(v, d) if v then return tonumber(v) or d end return d end

-- An integer (ms timestamps, sequence numbers) as a decimal string: the same text as tostring,
-- by sprintf's integer path instead of its floating-point one (%.14g: several times the work).
local function intstr(n)
  if n % 1 == 0 and n < 1e14 and n > -1e14 then return string.format('%d', n) end
  return tostring(n)
end

-- HGET and HDEL of one field as one command where the server has HGETDEL (Valkey 9, Redis 8);
-- HAS_HGETDEL lives as long as the library (false: this server lacks it).
local HAS_HGETDEL = nil
local function hgetdel(key, field)
  if HAS_HGETDEL then return redis.call('HGETDEL', key, 'FIELDS', '1', field)[1] end
  if HAS_HGETDEL == nil then
    local ok, r = pcall(redis.call, 'HGETDEL', key, 'FIELDS', '1', field)
    if ok then HAS_HGETDEL = true return r[1] end
    HAS_HGETDEL = false
  end
  local v = redis.call('HGET', key, field)
  if v then redis.call('HDEL', key, field) end
  return v
end

local function state()
  if not ST then
    local fields = STATE_FIELDS
    if MY_GW then  -- a batch: its gateway's ticket watermark and fence in the same read
      fields = {unpack(STATE_FIELDS)}
      table.insert(fields, 'hw:' .. MY_GW)
      table.insert(fields, 'bx:' .. MY_GW)
    end
    local v = redis.call('HMGET', K.state, unpack(fields))
    ST, ST_DIRTY = {}, {}
    for i, f in ipairs(fields) do ST[f] = v[i] or nil end
  end
  return ST
end

local function set_state(f, v)
  state()
  ST[f] = v
  ST_DIRTY[f] = true
  if f == 'limit' then LIM, ILIM, RES_L = nil, nil, nil end
end

-- In-flight and queued per class, read once per call; changes are written back by flush().
local function counts()
  if not INF then
    local v = redis.call('HMGET', K.counts, unpack(COUNT_FIELDS))
    -- `+ 0`: a string's number by one strtod (tonumber runs two)
    INF = {(v[1] or 0) + 0, (v[2] or 0) + 0, (v[3] or 0) + 0}
    QUE = {(v[4] or 0) + 0, (v[5] or 0) + 0, (v[6] or 0) + 0}
    NQ = {(v[7] or 0) + 0, (v[8] or 0) + 0, (v[9] or 0) + 0}
    NF = {(v[10] or 0) + 0, (v[11] or 0) + 0, (v[12] or 0) + 0}
    NF0 = {NF[1], NF[2], NF[3]}
    INF0 = {INF[1], INF[2], INF[3]}
    QUE0 = {QUE[1], QUE[2], QUE[3]}
    NQ0 = {NQ[1], NQ[2], NQ[3]}
    -- Never more waiters with a tenant than waiters, nor tenants than those: an older version's
    -- grant loop takes waiters without counting these down (a rolling upgrade). `sync` recounts.
    for k = 1, 3 do
      local n = math.max(0, math.min(NQ[k], QUE[k]))
      local f = math.min(NF[k], n)
      if n ~= NQ[k] or f ~= NF[k] then NQ[k], NF[k], CNT_DIRTY = n, f, true end
    end
  end
  return INF, QUE
end

local function add_inflight(c, d) counts() INF[c] = INF[c] + d CNT_DIRTY = true end
local function add_queued(c, d) counts() QUE[c] = QUE[c] + d CNT_DIRTY = true end
local function add_named(c, d) counts() NQ[c] = math.max(0, NQ[c] + d) CNT_DIRTY = true end
local function add_flow(c, d) counts() NF[c] = math.max(0, NF[c] + d) CNT_DIRTY = true end

-- Write back what this call changed in the counts and state hashes (mutating ops only).
local function flush()
  if CNT_DIRTY then
    local args = {}
    for k = 1, 3 do
      if INF[k] ~= INF0[k] then table.insert(args, COUNT_FIELDS[k]) table.insert(args, INF[k]) end
      if QUE[k] ~= QUE0[k] then table.insert(args, COUNT_FIELDS[k + 3]) table.insert(args, QUE[k]) end
      if NQ[k] ~= NQ0[k] then table.insert(args, COUNT_FIELDS[k + 6]) table.insert(args, NQ[k]) end
      if NF[k] ~= NF0[k] then table.insert(args, COUNT_FIELDS[k + 9]) table.insert(args, NF[k]) end
    end
    if #args > 0 then redis.call('HSET', K.counts, unpack(args)) end
  end
  if QSEQ and ST_DIRTY then ST.seq = intstr(QSEQ) end
  if FQ_DIRTY then
    ST.fq = string.format('%d %d %d %d %d %d %d %d %d', FQ.v[1], FQ.v[2], FQ.v[3], FQ.a[1], FQ.a[2], FQ.a[3],
                          FQ.t[1], FQ.t[2], FQ.t[3])
    ST_DIRTY.fq = true
  end
  if ST_DIRTY and next(ST_DIRTY) then
    for name, r in pairs(RT) do
      if ST_DIRTY[name] then ST[name] = string.format('%.14g|%d|%d|%d', r[1], r[2], r[3], r[4]) end
    end
    if ST_DIRTY['ramp:p'] and RAMP then ST['ramp:p'] = string.format('%.17g|%d', RAMP[1], RAMP[2]) end
    if ST_DIRTY['ramp:x'] then ST['ramp:x'] = RAMPX and string.format('%.17g|%d', RAMPX[1], RAMPX[2]) or '' end
    local args = {}
    for f in pairs(ST_DIRTY) do table.insert(args, f) table.insert(args, ST[f]) end
    redis.call('HSET', K.state, unpack(args))
  end
end

-- A message to one gateway on its channel for this pool (schema.gateway_channel), which shares
-- the pool's hash tag: SPUBLISH keeps it on this shard of a Cluster; a server without sharded
-- pub/sub (Redis 6) gets PUBLISH, and the gateway's SUBSCRIBE fallback matches it.
-- HAS_SPUBLISH: the server ran an SPUBLISH (kept for the library's life: no pcall per grant).
-- A failure is not remembered: the fallback stays per message, as before.
local HAS_SPUBLISH = false
local CHAN = {}  -- pool -> gateway -> channel name, kept for the library's life (one concat per grant less)
-- The pool's gateway channels start so (schema.gateway_channel).
local function channel_prefix() return 'fg:{' .. S.pool .. '}:gw:' end

local function channel(gw)
  local chans = CHAN[S.pool]
  if not chans then chans = {} CHAN[S.pool] = chans end
  local ch = chans[gw]
  if not ch then
    ch = channel_prefix() .. gw
    chans[gw] = ch
  end
  return ch
end

local function notify(gw, msg)
  local ch = channel(gw)
  if HAS_SPUBLISH then redis.call('SPUBLISH', ch, msg) return end
  HAS_SPUBLISH = pcall(redis.call, 'SPUBLISH', ch, msg)
  if not HAS_SPUBLISH then redis.call('PUBLISH', ch, msg) end
end

-- Whether a gateway's grant channel has a subscriber on this server. A processor that died
-- (SIGKILL, OOM kill, a crash) has its connections closed by the kernel, so its channel has none
-- from that moment, while its liveness in `gws` lasts until one lease TTL after its last sync.
-- A grant published then reaches no one and its permit stays held for that long: every permit
-- released went to the dead processor's waiters, and a pool serving 4 of L 4 served 2, then 0,
-- for the rest of the TTL (fault review). Asked in the same script as the grant, so the answer
-- holds for it. A live processor whose pub/sub connection is reconnecting also has none: its
-- waiter is dropped like a dead one's, and its poll (`mine` with '!gone') finds it gone and
-- re-queues it by a sync; one that knows its subscription is down (it could not subscribe:
-- a proxy or ACL without pub/sub, a connection being re-made) says so at every poll (`mine`
-- with '!deaf'), and is heard by its polls for a short while (state `pl:<gateway>`, ms): a
-- grant to it is found by its next poll, as before, and a process that dies in that mode stops
-- being heard when it stops polling. Sharded channels where the server has them (the
-- processors SSUBSCRIBE there), else plain ones.
local HAS_SHARDNUMSUB = nil
local function hears(gw)
  local v = HEARS[gw]
  if v ~= nil then return v end
  local ch, r = channel(gw), nil
  if HAS_SHARDNUMSUB then
    r = redis.call('PUBSUB', 'SHARDNUMSUB', ch)
  elseif HAS_SHARDNUMSUB == nil then
    local ok, got = pcall(redis.call, 'PUBSUB', 'SHARDNUMSUB', ch)
    if ok then HAS_SHARDNUMSUB, r = true, got else HAS_SHARDNUMSUB = false end
  end
  if not r then r = redis.call('PUBSUB', 'NUMSUB', ch) end
  v = (tonumber(r[2]) or 0) > 0
  if not v then  -- not subscribed: heard only if it said so at a recent poll
    local polls = redis.call('HGET', K.state, 'pl:' .. gw)
    v = (polls and polls + 0 > now) or false
  end
  HEARS[gw] = v
  return v
end

local function load_settings()
  local stamp = redis.call('HGET', K.settings, 'stamp')
  local hit = stamp and SCACHE[K.settings]
  if hit and hit.stamp == stamp then S = hit.S return true end
  local raw = redis.call('HGETALL', K.settings)
  if #raw == 0 then S = false return false end
  local f = {}
  for i = 1, #raw, 2 do f[raw[i]] = raw[i + 1] end
  S = {initial = tonumber(f.initial), picking = f.picking == '1', epoch = tonumber(f.epoch or '0'),
       pool = f.pool or '', shares = {}, always = {}, headroom = {}, maxq = {}, tcap = {},
       -- the onset ramp (absent in older settings: off); the rate per ms of the script's clock
       ramp_burst = tonumber(f.ramp_burst or '0'), ramp_rate_ms = tonumber(f.ramp_rate or '0') / 1000,
       ramp_min_burst = tonumber(f.ramp_min_burst or '8'), ramp_min_rate_ms = tonumber(f.ramp_min_rate or '8') / 1000,
       -- the floors per active endpoint (absent in older settings: none)
       ramp_ep_burst = tonumber(f.ramp_ep_burst or '0'), ramp_ep_rate_ms = tonumber(f.ramp_ep_rate or '0') / 1000,
       -- prefill-aware picking (absent in older settings: off); tokens per ms of the script's clock
       pf_rate_ms = tonumber(f.pf_rate or '0') / 1000, pf_size = tonumber(f.pf_size or '512'),
       pf_k = tonumber(f.pf_k or '512'),
       -- the fair order over tenants; off: one flow, arrival order. Absent (settings stored by
       -- a version before it, which queued in arrival order): off, as they ran, like every
       -- other field added since (read as on, an upgrade turned it on under configs that say
       -- `fair_order: false`, where clients choose their tenant: a review)
       fair = f.fair == '1'}
  for k = 1, 3 do
    S.shares[k] = tonumber(f['share' .. (k - 1)])
    S.always[k] = f['always' .. (k - 1)] == '1'
    S.headroom[k] = tonumber(f['headroom' .. (k - 1)] or '0')  -- absent in older settings: none
    S.maxq[k] = tonumber(f['maxq' .. (k - 1)])
    S.tcap[k] = tonumber(f['tcap' .. (k - 1)])
  end
  if f.stamp then SCACHE[K.settings] = {stamp = f.stamp, S = S} end
  return true
end

-- Exponentially decayed event rates (events per second) in the state hash: `rate` counts freed
-- permits, `g0..g2` grants per class. `<name>_t0` and `<name>_n` let read_rate() correct the
-- start-up bias and say "unknown" (0) until it has seen enough.
local function rate_rec(name)
  local rec = RT[name]
  if not rec then
    local r, ts, t0, n = string.match(state()[name] or '', '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
    if r then rec = {r + 0, ts + 0, t0 + 0, n + 0} else rec = {0, now, now, 0} end
    RT[name] = rec
  end
  return rec
end

local function unpack_rate(name)
  local rec = rate_rec(name)
  return rec[1], rec[2], rec[3], rec[4]
end

local function bump_rate(name, n)
  n = n or 1
  local rec = rate_rec(name)
  rec[1] = rec[1] * math.exp(-(now - rec[2]) / RATE_TAU_MS) + n * 1000 / RATE_TAU_MS
  rec[2] = now
  rec[4] = math.min(rec[4] + n, 1000000)
  ST_DIRTY[name] = true  -- flush formats it
  RRATE[name] = nil
end

local function read_rate(name)
  local v = RRATE[name]
  if v then return v end
  local rate, ts, t0, n = unpack_rate(name)
  if n < RATE_MIN_EVENTS or now - t0 < RATE_MIN_AGE_MS then
    v = 0
  else
    local seen = 1 - math.exp(-(now - t0) / RATE_TAU_MS)
    v = rate * math.exp(-(now - ts) / RATE_TAU_MS) / seen
  end
  RRATE[name] = v
  return v
end

-- The limit; `write` stores the initial one when the pool has none yet (never on a read).
local function limit_value(write)
  if LIM then return LIM end
  local l = tonumber(state().limit)  -- (not a number: written by something else; as none)
  if l then LIM = l return LIM end
  local initial = (S and S.initial) or 1
  if write then
    set_state('limit', tostring(initial))
    set_state('version', '0')
  end
  return initial
end

local function int_limit(write)
  if ILIM then return ILIM end
  local L = math.max(1, math.floor(limit_value(write)))
  if LIM then ILIM = L end  -- only once stored (a read of a pool without a limit stores nothing)
  return L
end

-- The onset ramp, mirrored from policy.py (ramp_refill, ramp_paces) and permits.py: while a P0
-- is in flight, a lower-class grant needs a token; every grant takes one (credits too), every
-- lease that ends gives one back, and tokens accrue at max(floor rate, ramp_rate x L) per
-- second up to max(floor burst, ramp_burst x L). The floors (policy.ramp_floors) are the
-- pool-wide ones, or the per-endpoint ones times the registry's active endpoints when more. The
-- bucket is brought to `now` once at the start of each op that grants or frees (as the
-- reference model does), in the same float arithmetic, and stored with 17 digits so the model
-- and the script compare the same numbers.
local function n_active()
  if not NACTIVE then NACTIVE = redis.call('SCARD', K.active) end
  return NACTIVE
end
local function ramp_floor_burst()
  if S.ramp_ep_burst <= 0 then return S.ramp_min_burst end
  return math.max(S.ramp_min_burst, S.ramp_ep_burst * n_active())
end
local function ramp_floor_rate()
  if S.ramp_ep_rate_ms <= 0 then return S.ramp_min_rate_ms end
  return math.max(S.ramp_min_rate_ms, S.ramp_ep_rate_ms * n_active())
end
local function ramp_cap(L) return math.max(ramp_floor_burst(), S.ramp_burst * L) end

local function ramp_refill()
  if S.ramp_rate_ms <= 0 then return end
  local L = int_limit(true)
  if not RAMP then
    local tk, ts = string.match(state()['ramp:p'] or '', '^([^|]*)|([^|]*)$')
    if tk then RAMP = {tonumber(tk), tonumber(ts)} end
  end
  if not RAMP then
    RAMP = {ramp_cap(L), now}
  else
    RAMP[1] = math.min(ramp_cap(L), RAMP[1] + math.max(ramp_floor_rate(), L * S.ramp_rate_ms) * math.max(0, now - RAMP[2]))
    RAMP[2] = now
  end
  ST_DIRTY['ramp:p'] = true  -- flush formats it
end

-- The ramp credit of endpoints that just turned active (set_limit's `credit`, policy.py
-- `ramp_credit`): their slots are empty, so lower-class prompts routed to them queue ahead of
-- no P0, and the growth of the limit they bring may be taken at once instead of at the ramp's
-- rate. Tokens beside the bucket (grants take them first), never given back, gone at `until`.
local function ramp_extra()
  if RAMPX == nil then
    local tk, u = string.match(state()['ramp:x'] or '', '^([^|]*)|([^|]*)$')
    RAMPX = false
    if tk and tonumber(u) > now and tonumber(tk) >= 1 then RAMPX = {tonumber(tk), tonumber(u)} end
  end
  return RAMPX and RAMPX[1] or 0
end

-- May class c (1-based) take a permit now as far as the ramp goes? P0 always; lower classes
-- freely while no P0 is in flight.
local function ramp_open(c, inflight)
  return S.ramp_rate_ms <= 0 or c == 1 or inflight[1] == 0 or not RAMP or RAMP[1] >= 1 or ramp_extra() >= 1
end

local function ramp_take(n)
  if not RAMP then return end
  local x = ramp_extra()
  if x >= 1 then
    local k = math.min(n, math.floor(x))
    RAMPX[1] = x - k
    ST_DIRTY['ramp:x'] = true
    n = n - k
  end
  RAMP[1] = RAMP[1] - n
end

local function ramp_give()
  if RAMP then RAMP[1] = math.min(ramp_cap(int_limit(true)), RAMP[1] + 1) end
end

-- policy.eligible, mirrored: below the limit any class may take a free permit; a class inside
-- its reservation always may; otherwise what stays free must still cover the unused
-- reservations of the other classes that have waiters (or keep theirs `always`), plus the
-- headroom of every higher class (policy.kept_free: permits only the higher class may take).
local function eligible(c, L, inflight, queued)
  local free = L - inflight[1] - inflight[2] - inflight[3]
  if free < 1 then return false end
  if RES_L ~= L then
    RES, RES_L = {}, L
    for k = 1, 3 do
      RES[k] = math.floor(S.shares[k] * L + 1e-9)
      RES[k + 3] = math.floor(S.headroom[k] * L + 1e-9)
    end
  end
  local res = RES
  if inflight[c] < res[c] then return true end
  local others = 0
  for k = 1, 3 do
    if k ~= c and (queued[k] > 0 or S.always[k]) then others = others + math.max(0, res[k] - inflight[k]) end
    if k < c then others = others + res[k + 3] end
  end
  return free - 1 >= others
end

local function gateway_alive(gw)
  if ALIVE[gw] == nil then
    local exp = redis.call('ZSCORE', K.gws, gw)
    ALIVE[gw] = (exp and exp + 0 > now) or false  -- dead from the same ms its leases expire
    LIVE_UNTIL[gw] = exp and exp + 0
  end
  return ALIVE[gw]
end

-- Its liveness is here and has run out: what a clock step past the TTL does to a live gateway
-- (the jump hold below). A gateway with no liveness at all left cleanly (`leave`), or its
-- fields outlived it (a clean stop before `leave` dropped them, a batch that landed after
-- it): its old fence says nothing about the clock (a soak review: a restart under the same id
-- after a clean stop held every grant of the pool).
local function gateway_lapsed(gw)
  return not gateway_alive(gw) and LIVE_UNTIL[gw] ~= nil and LIVE_UNTIL[gw] ~= false
end

-- The hold after lost writes (OPS.batch): Redis answered without writes it had acknowledged
-- (a failover to a replica that missed them, a planned switchover where the old primary took
-- writes after the promotion), so the permits it counts are stale for every gateway, not only
-- for the one that noticed: each may hold permits leased in the lost writes, and the freed
-- ones it shows would be granted twice. No permit is granted (leases re-asserted by `sync`
-- still are) until every gateway that was alive in the state Redis went back to (or lapsed
-- there within a TTL: its renewals may be among the lost writes) has synced, or has not been
-- heard here (`hears`: subscribed, or polling) HOLD_QUIET_MS after the hold began (a processor
-- killed around the failover: otherwise it held every grant for the whole hold; a live one
-- moves its connections here within a follower interval and a reconnect), or the hold runs out
-- (one renewal period and a second: every live gateway syncs within a renewal period). Its
-- liveness here does not end the wait: it is as old as the lost state.
-- State field `hold` = "until_ms|start_ms|gw gw ...", '' when none.
local HOLD_QUIET_MS = 2000
-- A hold's length: one renewal period and a second, at the caller's lease TTL.
local function hold_ms() return math.floor(ttl / 3) + 1000 end

-- Write the state field: `u` nil for an ended hold ("0"), `t0` nil when unknown; `mark`, after
-- its start: 'j' a hold after the server's clock jumped, 'e' one after Redis was emptied
-- (start_hold), nil any other.
local function store_hold(u, t0, gws, mark)
  set_state('hold', (u and intstr(u) or '0') .. '|' .. (t0 and intstr(t0) or '') .. ((u and mark) or '')
            .. '|' .. table.concat(gws, ' '))
end

-- The stored list keeps every listed gateway until it syncs (`hold_synced`); the ones waited
-- for are all of them and, after HOLD_QUIET_MS, those heard. An ended hold leaves
-- "0|start_ms|gateways that never synced" (start_hold reads it). `capped` (every call but a
-- status read, whose TTL is a tool's): a start in the future or an end further than one hold's
-- length from it (the server's clock stepped back, a value written by something else) ends
-- it, so a hold never lasts for good.
local function held(capped)
  if HOLD == nil then
    HOLD = false
    local v = state().hold
    if v and v ~= '' then
      local u, t0, rest = string.match(v, '^([^|]*)|([^|]*)|(.*)$')
      local mark = string.match(t0 or '', '[je]$')
      if mark then t0 = string.sub(t0, 1, -2) end
      u, t0 = tonumber(u or ''), tonumber(t0 or '')
      if u == 0 then
        if not t0 or t0 > now or now - t0 >= 2 * hold_ms() then set_state('hold', '') end  -- forgotten
      else
        local listed, left = {}, {}
        for gw in string.gmatch(rest or '', '%S+') do table.insert(listed, gw) end
        if u and t0 and t0 <= now and now < u and (capped == false or u - t0 <= hold_ms()) then
          local quiet = now - t0 >= HOLD_QUIET_MS
          -- Only hearing a listed gateway tells a live one, not its liveness here: after a
          -- clock jump every one reads dead, and after lost writes its liveness is as old as
          -- the rest of the state (it renewed on the server whose writes were lost; a
          -- processor moving late, or reconnecting after its first call on the new primary
          -- timed out, read dead here while its permits ran, and the grants filled them).
          -- After Redis was emptied ('e') the list is whoever listens on the pool's channels, which
          -- are server-wide: a processor of another deployment in another database number is heard
          -- and never syncs here (a review: a hold of 11 s). Told to sync at once, a processor of
          -- this pool has done so within the quiet time; the rest are not waited for.
          for _, gw in ipairs(listed) do
            if not (quiet and (mark == 'e' or not hears(gw))) then table.insert(left, gw) end
          end
        end
        if #left > 0 then
          HOLD = {u, t0, listed, left, mark}
        else  -- over: the next grant loop grants again
          store_hold(nil, t0 and t0 <= now and t0 or nil, listed)
        end
      end
    end
  end
  return HOLD ~= false
end

-- Lost writes seen (OPS.batch): hold the grants until every live gateway has synced, and ask
-- each (but the caller, whose processor re-asserts by itself) to sync now. A gateway that an
-- earlier hold (begun less than two holds' length ago) listed and that never synced is that
-- loss arriving late (it was dropped as not heard, or came after the hold ran out): its hold
-- lists only itself and the gateways that have not synced since that hold began (the others
-- re-asserted after the loss), not everyone once more (a review: each late processor had every
-- other refused and told to sync again).
--
-- `jump`: the caller's own liveness ran out while it is calling, with its fence still here:
-- the server's clock jumped forward (an NTP step, a VM resumed on the Redis host) past the
-- lease TTL, and this call's reclaim is about to expire every lease and declare every gateway
-- dead at once. Without a hold, a review read 10-13 in flight of L 8 (a 20 s step at TTL
-- 15 s): the grants made before the processors re-asserted their permits came on top of the
-- requests still running. The hold lists every gateway registered here (dead by the jumped
-- clock, so only being heard keeps one listed) and asks each to sync, the caller too (its
-- fence goes with the reclaim, so it would notice only at its next call). A processor that
-- itself stalled past the TTL trips it too: a short pause of the grants until all re-assert.
-- The gateways listening on this pool's grant channels, shaped as `gws` WITHSCORES (score 0),
-- the caller among them: after the keys were emptied (a restart without persistence, a
-- FLUSHALL) no liveness is left to list, but the server's pub/sub still knows the processors
-- (a subscription outlives a FLUSHALL; after a restart each subscribes again within seconds).
local function listeners()
  local prefix = channel_prefix()
  local pat = string.gsub(prefix, '[%*%?%[%]\\]', '\\%0') .. '*'
  local found = {}
  local ok, shard = pcall(redis.call, 'PUBSUB', 'SHARDCHANNELS', pat)
  if ok then found[1] = shard end
  found[#found + 1] = redis.call('PUBSUB', 'CHANNELS', pat)
  local out, seen = {}, {}
  for _, chans in ipairs(found) do
    for _, ch in ipairs(chans) do
      local gw = string.sub(ch, #prefix + 1)
      if gw ~= '' and not seen[gw] then seen[gw] = true out[#out + 1] = gw out[#out + 1] = 0 end
    end
  end
  if not seen[MY_GW] then out[#out + 1] = MY_GW out[#out + 1] = 0 end
  return out
end

local function start_hold(jump, emptied)
  local gws
  if jump then
    gws = redis.call('ZRANGE', K.gws, 0, -1, 'WITHSCORES')
  elseif emptied then
    gws = listeners()
  else
    -- Alive here, or lapsed within a TTL: a liveness in the state Redis went back to may have
    -- been renewed in the writes it lost.
    gws = redis.call('ZRANGEBYSCORE', K.gws, '(' .. intstr(now - ttl), '+inf', 'WITHSCORES')
  end
  local prev, never = string.match(state().hold or '', '^0|([^|]*)|(.*)$')
  prev = tonumber(prev or '')
  local late = false
  if prev and prev <= now and now - prev < 2 * hold_ms() and not jump then
    for gw in string.gmatch(never or '', '%S+') do if gw == MY_GW then late = true end end
  end
  local list = {}
  for i = 1, #gws, 2 do
    -- (gws holds each gateway's last sync + the TTL: every processor of a pool runs the same)
    if not late or gws[i] == MY_GW or gws[i + 1] - ttl < prev then table.insert(list, gws[i]) end
  end
  if #list == 0 then return end
  local u = now + hold_ms()
  local mark = (jump and 'j') or (emptied and 'e') or nil
  HOLD = {u, now, list, list, mark}
  store_hold(u, now, list, mark)
  for _, gw in ipairs(list) do
    if gw ~= MY_GW or jump then notify(gw, S.pool .. '|!resync|') end
  end
end

-- A gateway re-asserted everything it holds (`sync`): the hold no longer waits for it.
local function hold_synced(gw)
  if not held() then return end
  local listed = {}
  for _, g in ipairs(HOLD[3]) do if g ~= gw then table.insert(listed, g) end end
  if #listed == #HOLD[3] then return end
  store_hold(#listed > 0 and HOLD[1] or nil, HOLD[2], listed, HOLD[5])
  HOLD = nil  -- read again: the ones left may all be dead or not heard
end

-- Prefill-aware picking, mirrored from extproc/prefill.py (PrefillEstimate): with picking and
-- `pf_rate`, each active endpoint has an estimate of the prompt tokens routed to it and not yet
-- prefilled, `epfill` endpoint -> "level|ms": every request routed there adds its prompt size
-- (the op's `size` argument: the processor's estimate from its content-length; `pf_size` when the
-- op has none, as an older processor sends it), and it drains at `pf_rate` tokens per second,
-- never below 0. Grants go to the least estimate, and while a P0 is in flight a lower class is
-- granted only while the least is at most `pf_k`. A waiter's size waits with it in `qsize`.
local function pf_on() return S.picking and S.pf_rate_ms > 0 end

-- An op's size argument: a finite number >= 0, else nil (not given: pf_size).
local function size_arg(v)
  local n = tonumber(v or '')
  if n and n >= 0 and n < math.huge then return n end
  return nil
end

-- The ejected endpoints (extproc/ejection.py): state `ej` = "endpoint|until_ms ..." (space
-- separated; an endpoint holds neither '|' nor a space). {endpoint, until} of those not ended.
local function ejections()
  local out = {}
  local raw = state().ej
  if raw and raw ~= '' then
    for ep, u in string.gmatch(raw, '([^|%s]+)|(%d+)') do
      u = u + 0
      if u > now then out[#out + 1] = {ep, u} end
    end
  end
  return out
end

-- Write {endpoint, until} pairs back as the state field `ej` (the format `ejections` reads).
local function store_ejections(list)
  local parts = {}
  for i, x in ipairs(list) do parts[i] = x[1] .. '|' .. intstr(x[2]) end
  set_state('ej', table.concat(parts, ' '))
end

-- The active endpoints a grant may go to: without the ejected ones, unless every one is.
local function unejected(eps)
  local ej = ejections()
  if #ej == 0 then return eps end
  local out, gone = {}, {}
  for _, x in ipairs(ej) do gone[x[1]] = true end
  for _, ep in ipairs(eps) do
    if not gone[ep] then out[#out + 1] = ep end
  end
  if #out == 0 then return eps end
  return out
end

-- The active endpoints (sorted, ejected ones left out: `unejected`) and their estimates at `now`,
-- read once per call (the registry is written outside the script, so neither changes within a
-- call but by this call's picks).
local function pf_read()
  if PF then return PF end
  local eps = unejected(redis.call('SMEMBERS', K.active))
  table.sort(eps)
  local lv = {}
  if #eps > 0 and pf_on() then
    local raw = redis.call('HMGET', K.epfill, unpack(eps))
    for i, ep in ipairs(eps) do
      local l, ts = string.match(raw[i] or '', '^([^|]*)|([^|]*)$')
      local v = 0
      if l then v = math.max(0, tonumber(l) - S.pf_rate_ms * math.max(0, now - tonumber(ts))) end
      lv[ep] = v
    end
  end
  PF = {eps = eps, lv = lv}
  return PF
end

-- May class c (1-based) take a permit now as far as prefill pacing goes? P0 always; lower
-- classes freely while no P0 is in flight (or no endpoint is active: the caller answers 503).
local function pf_open(c, inflight)
  if c == 1 or inflight[1] == 0 or not pf_on() then return true end
  local pf = pf_read()
  if #pf.eps == 0 then return true end
  local least = math.huge
  for _, ep in ipairs(pf.eps) do least = math.min(least, pf.lv[ep]) end
  return least <= S.pf_k
end

-- The least-loaded active endpoint: with prefill-aware picking the least estimate first, then
-- the fewest permits routed to it; ties rotate so that an idle pool still spreads requests.
-- '' when the pool has no active endpoint.
local function pick(size)
  local pf = pf_read()
  local eps = pf.eps
  local n = #eps
  if n == 0 then return '' end
  local rr = num(state().rr, 0) + 1
  set_state('rr', tostring(rr))
  local start = rr % n
  local loads = redis.call('HMGET', K.epinf, unpack(eps))
  local on = pf_on()
  local best, best_lv, best_load = '', math.huge, math.huge
  for i = 0, n - 1 do
    local j = (start + i) % n + 1
    local load = num(loads[j], 0)
    local lv = on and pf.lv[eps[j]] or 0
    if lv < best_lv or (lv == best_lv and load < best_load) then best, best_lv, best_load = eps[j], lv, load end
  end
  if on then
    local v = best_lv + (size or S.pf_size)
    pf.lv[best] = v
    redis.call('HSET', K.epfill, best, string.format('%.17g|%d', v, now))
    -- endpoints that left the active set keep a field until there are many of them
    if redis.call('HLEN', K.epfill) > n + 16 then
      for _, ep in ipairs(redis.call('HKEYS', K.epfill)) do
        if pf.lv[ep] == nil then redis.call('HDEL', K.epfill, ep) end
      end
    end
  end
  return best
end

-- lmeta = "class|gateway|seq"; qmeta = "class|deadline|gateway|seq|tenant" (tenant last: it
-- may contain '|'). `seq` is the gateway's ticket number, which `sync` compares to its watermark.
local function parse_lmeta(m)
  local c, gw, seq = string.match(m or '', '^(%d)|(.*)|(%d+)$')
  return CLASS0[c] or 1, gw or '', seq or '0'  -- seq as stored (a string)
end

local function parse_qmeta(m)
  local c, dl, gw, seq, tenant = string.match(m, '^(%d)|([^|]*)|([^|]*)|(%d+)|(.*)$')
  return CLASS0[c], dl and dl + 0, gw, seq, tenant  -- seq as stored (a string); dl + 0: one strtod (tonumber: two)
end

-- Reclaim has work from `t` (ms) on: a lease expiring, a waiter's deadline plus grace, a
-- gateway's liveness ending. Every insertion lowers `due`; reclaim recomputes it.
local function lower_due(t)
  if DUE == nil then DUE = num(state().due, -1) end
  if t < DUE or DUE < 0 then
    DUE = t
    set_state('due', intstr(t))
  end
end

-- c is 0-based here (as stored).
local function put_lease(ticket, c, gw, seq, ep, until_ms)
  if until_ms and until_ms < now + ttl then
    redis.call('ZADD', K.leases, intstr(until_ms), ticket)
    lower_due(until_ms)
  else
    redis.call('ZADD', K.leases, EXPIRY_S, ticket)
    lower_due(now + ttl)
  end
  redis.call('HSET', K.lmeta, ticket, CLS[c + 1] .. '|' .. gw .. '|' .. seq)
  add_inflight(c + 1, 1)
  if ep ~= '' then
    redis.call('HSET', K.lep, ticket, ep)
    HAS_LEP = true
    redis.call('HINCRBY', K.epinf, ep, 1)
  end
end

-- A new grant to class c (1-based): leased, counted as a grant, routed when picking.
-- `until_ms`: the lease ends no later (a waiter's grant: its gateway's liveness); `size`: its
-- prompt tokens for the prefill estimate (nil: pf_size).
local function lease(ticket, c, gw, seq, until_ms, size)
  local ep = ''
  if S.picking then ep = pick(size) end
  put_lease(ticket, c - 1, gw, seq, ep, until_ms)
  bump_rate(GRATE[c])
  ramp_take(1)
  return ep
end

-- Fair order within a class (start-time fair queueing over tenants): a waiter's queue score is
-- its flow's virtual start tag, not its arrival. A flow is one tenant; the requests without a
-- tenant are one flow together. Per class: `v` the tag of the waiter granted last (virtual
-- time: the round under way), `a` the next tag of the tenant-less flow, `t` the highest tag
-- given (every waiter's tag is at most it). A named tenant's next tag is the counts field
-- `f<class>:<tenant>`, dropped with its last waiter. A new waiter's tag is max(v + 1, its flow's
-- next tag), and its flow's next tag becomes that + 1: one flow alone is served in arrival
-- order, a tenant with no waiters joins the next round (behind the round under way, not in it:
-- a flow just served that came back at v, and every new tenant, passed a waiter at v + 1 for
-- as long as such flows kept coming — a review), and a flooding tenant's waiters spread out
-- behind everyone else's (one grant per flow per round). A round's members are fixed once it
-- is under way, so every waiter is reached. Without the state field (a
-- pool queued by an older version, whose scores are the queue sequence) tags start past it.
local function fair()
  if not FQ then
    local v1, v2, v3, a1, a2, a3, t1, t2, t3 = string.match(state().fq or '',
      '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
    if v1 then
      FQ = {v = {v1 + 0, v2 + 0, v3 + 0}, a = {a1 + 0, a2 + 0, a3 + 0}, t = {t1 + 0, t2 + 0, t3 + 0}}
    else
      local s0 = num(state().seq, 0) % CLASS_SPAN + 1
      FQ = {v = {s0, s0, s0}, a = {s0, s0, s0}, t = {s0, s0, s0}}
      FQ_DIRTY = true
    end
  end
  return FQ
end

local function flow_field(c, tenant) return 'f' .. CLS[c] .. ':' .. tenant end

-- The tag a new waiter of class c (1-based) and this flow would get; `named_next`: the named
-- tenant's next tag as stored (nil: none).
local function next_tag(c, tenant, named_next)
  local F = fair()
  if tenant == '' then return math.max(F.v[c] + 1, F.a[c]) end
  return math.max(F.v[c] + 1, num(named_next, 0))
end

-- Tags only grow (about one per waiter ever queued in the class, and the state keeps them for
-- good), while a queue score holds a tag modulo CLASS_SPAN: past 2^32 a class's new waiters
-- sorted ahead of its old ones, and its virtual time stopped moving (a granted head's wrapped
-- tag is below it), so every new tenant passed every backlogged flow from then on. Once the
-- highest tag given reaches FQ_REBASE_AT, the class's tags are shifted down by its virtual time
-- (no waiter's tag is below it): its waiters' scores, its flows' next tags and the state's. The
-- order is unchanged; the work is one pass over the class's waiters, once per 2^31 tags.
local FQ_REBASE_AT = 2147483648
local function rebase(c)
  local F = fair()
  local d = F.v[c]
  if F.t[c] < FQ_REBASE_AT or d <= 0 then return end
  local lo = (c - 1) * CLASS_SPAN
  local q = redis.call('ZRANGEBYSCORE', K.queue, CLASS_LO[c], CLASS_HI[c], 'WITHSCORES')
  for i = 1, #q, 2 do
    redis.call('ZADD', K.queue, math.max(lo, tonumber(q[i + 1]) - d), q[i])
  end
  local prefix = 'f' .. CLS[c] .. ':'
  local cf = redis.call('HGETALL', K.counts)
  for i = 1, #cf, 2 do
    local n = string.sub(cf[i], 1, #prefix) == prefix and tonumber(cf[i + 1])
    if n then redis.call('HSET', K.counts, cf[i], intstr(math.max(0, n - d))) end
  end
  F.v[c], F.a[c], F.t[c] = 0, math.max(0, F.a[c] - d), math.max(0, F.t[c] - d)
  FQ_DIRTY = true
end

-- A granted head's tag moves class c's virtual time (`score`: its queue score).
local function advance(c, score)
  local tag = math.floor(score - (c - 1) * CLASS_SPAN)
  local F = fair()
  if tag > F.v[c] then F.v[c] = tag FQ_DIRTY = true end
end

-- `popped`: the caller already removed it from the queue and its meta (ZPOPMIN, HGETDEL)
-- and parsed the meta (c 0-based, tenant).
local function unqueue(ticket, meta, popped, c, tenant)
  if not popped then
    local _
    c, _, _, _, tenant = parse_qmeta(meta)
    redis.call('ZREM', K.queue, ticket)
    redis.call('HDEL', K.qmeta, ticket)
    if pf_on() then redis.call('HDEL', K.qsize, ticket) end  -- popped: the grant loop took it
  end
  redis.call('ZREM', K.qdl, ticket)
  add_queued(c + 1, -1)
  if not popped and EDGE then EDGE[c + 1] = nil end  -- popped: the grant loop updates EDGE
  if tenant ~= '' then  -- no cap applies to a request without a tenant: nothing to count
    add_named(c + 1, -1)
    local field = 't' .. CLS[c + 1] .. ':' .. tenant
    local n = redis.pcall('HINCRBY', K.counts, field, -1)  -- (not a number: as its last waiter)
    if type(n) ~= 'number' or n <= 0 then
      redis.call('HDEL', K.counts, field, flow_field(c + 1, tenant))  -- and its flow's tag: no backlog
      add_flow(c + 1, -1)
    end
  end
  -- The tenant-less flow (every waiter's with the fair order off) has no waiter left: no backlog either.
  if (tenant == '' or not S.fair) and QUE[c + 1] <= (S.fair and NQ[c + 1] or 0) then
    local F = fair()
    if F.a[c + 1] > F.v[c + 1] then F.a[c + 1] = F.v[c + 1] FQ_DIRTY = true end
  end
end

-- c is 0-based here (as stored). `size`: its prompt tokens (nil: pf_size, nothing stored).
local function put_waiter(ticket, c, deadline, gw, seq, tenant, size)
  if not QSEQ then QSEQ = num(state().seq, 0) end
  QSEQ = QSEQ + 1
  ST_DIRTY.seq = true  -- flush writes it
  local qseq = QSEQ
  rebase(c + 1)
  local F, tag = fair(), nil
  if tenant == '' or not S.fair then
    tag = next_tag(c + 1, '')
    F.a[c + 1] = tag + 1
  else
    local ff = flow_field(c + 1, tenant)
    tag = next_tag(c + 1, tenant, redis.call('HGET', K.counts, ff))
    redis.call('HSET', K.counts, ff, intstr(tag + 1))
  end
  if tenant ~= '' then add_named(c + 1, 1) end
  local tail = tag >= F.t[c + 1]
  if tag > F.t[c + 1] then F.t[c + 1] = tag end
  FQ_DIRTY = true
  redis.call('ZADD', K.queue, c * CLASS_SPAN + tag % CLASS_SPAN + (qseq % TIE_SPAN) / TIE_SPAN, ticket)
  local dl = intstr(deadline)
  redis.call('ZADD', K.qdl, dl, ticket)
  lower_due(deadline + WAITER_GRACE_MS)
  redis.call('HSET', K.qmeta, ticket, CLS[c + 1] .. '|' .. dl .. '|' .. gw .. '|' .. seq .. '|' .. tenant)
  -- (a separate hash, not a qmeta field: processors of an older version share the queue and
  -- parse qmeta as they wrote it)
  if size and pf_on() then redis.call('HSET', K.qsize, ticket, size) end
  add_queued(c + 1, 1)
  local e = EDGE and EDGE[c + 1]
  if not tail then  -- placed ahead of others (fair order): the memo's edges may both have moved
    if EDGE then EDGE[c + 1] = nil end
  elseif e then e[2] = deadline elseif e == false then EDGE[c + 1] = {deadline, deadline} end
  if tenant ~= '' then
    -- (pcall: a count that is not a number, written by something else, restarts at 1; the next
    -- renewal recounts it)
    local f = 't' .. CLS[c + 1] .. ':' .. tenant
    local n = redis.pcall('HINCRBY', K.counts, f, 1)
    if type(n) ~= 'number' then redis.call('HSET', K.counts, f, 1) n = 1 end
    if n == 1 then add_flow(c + 1, 1) end
  end
end

-- Time-weighted mean in-flight (decay RATE_TAU_MS) sampled at each release, `lvl` in the state
-- hash: with the release rate it gives the mean hold time (Little), so the policy can tell
-- that a pool which just filled up frees permits faster than its decayed rate says.
local function bump_level()
  if LVL_DONE then return end
  LVL_DONE = true
  local inflight = counts()
  local total = inflight[1] + inflight[2] + inflight[3]
  local v = total
  local lvl, ts = string.match(state()['lvl:p'] or '', '^([^|]*)|([^|]*)$')
  if ts then
    local w = math.exp(-math.max(0, now - ts) / RATE_TAU_MS)
    v = lvl * w + (1 - w) * total
  end
  set_state('lvl:p', string.format('%.14g|%d', v, now))
  LVL_S = nil
end

-- `count_rate`: a completion (rate and level events), not an idle credit handed back.
local function drop_lease(ticket, count_rate)
  if redis.call('ZREM', K.leases, ticket) == 0 then
    -- No lease (lost with the leases key, say): its meta and route go too. The counts are the
    -- next renewal's to correct.
    if redis.call('HDEL', K.lmeta, ticket) == 1 then redis.call('HDEL', K.lep, ticket) end
    return false
  end
  if count_rate then bump_level() end  -- sampled with the lease still counted
  local c = parse_lmeta(hgetdel(K.lmeta, ticket))
  add_inflight(c + 1, -1)
  ramp_give()
  if HAS_LEP == nil then HAS_LEP = redis.call('EXISTS', K.lep) == 1 end
  local ep = HAS_LEP and redis.call('HGET', K.lep, ticket)
  if ep then
    redis.call('HDEL', K.lep, ticket)
    if redis.call('HINCRBY', K.epinf, ep, -1) <= 0 then redis.call('HDEL', K.epinf, ep) end
  end
  if count_rate then bump_rate('rate:p') end
  return true
end

-- Hand free permits to waiters: highest eligible class first, FIFO within it. Each waiter is
-- popped before it is leased, so no permit is ever granted twice. Waiters past their deadline
-- or of a gateway that stopped syncing are dropped, never granted.
-- Take class c's head off the queue (the caller removes its meta): one ZPOPMIN when no
-- higher class waits (the usual case), else by score range.
local function pop_head(c, queued)
  local lower = true
  for k = 1, c - 1 do if queued[k] > 0 then lower = false end end
  if lower then
    local p = redis.call('ZPOPMIN', K.queue)
    if not p[1] then return nil end
    local score = p[2] + 0
    if score >= (c - 1) * CLASS_SPAN and score < c * CLASS_SPAN then
      advance(c, score)
      return p[1]
    end
    redis.call('ZADD', K.queue, p[2], p[1])  -- another class's (a drifted count): put it back
  end
  -- LIMIT as strings here and below: a number argument costs a sprintf in the call bridge.
  local h = redis.call('ZRANGEBYSCORE', K.queue, CLASS_LO[c], CLASS_HI[c], 'WITHSCORES', 'LIMIT', '0', '1')
  local head = h[1]
  if head then
    redis.call('ZREM', K.queue, head)
    advance(c, h[2] + 0)
  end
  return head
end

local function grant_loop()
  if held() then return 0 end
  local L = int_limit(true)
  local granted = 0
  local inflight, queued = counts()
  for _ = 1, 10000 do
    if inflight[1] + inflight[2] + inflight[3] >= L then break end
    local progressed = false
    for c = 1, 3 do
      if queued[c] > 0 and eligible(c, L, inflight, queued) then
        -- paced: waits for a token of the onset ramp, or for the engines' prefill estimate
        if not ramp_open(c, inflight) or not pf_open(c, inflight) then return granted end
        local head = pop_head(c, queued)
        if not head then
          queued[c] = 0  -- repair a drifted counter
          NQ[c], NF[c] = 0, 0
          CNT_DIRTY = true
        else
          local meta = hgetdel(K.qmeta, head)
          local size = pf_on() and size_arg(hgetdel(K.qsize, head)) or nil
          if not meta and EDGE then EDGE[c] = nil end
          if meta then
            local qc, deadline, gw, seq, tenant = parse_qmeta(meta)
            unqueue(head, meta, true, qc, tenant)
            -- The head of class c left: the memo's tail stays (the newest waiter), the head is
            -- read again when a snapshot needs it (edges_left).
            local e = EDGE and EDGE[c]
            if e and qc + 1 == c then e[1] = nil elseif EDGE then EDGE[c] = nil EDGE[qc + 1] = nil end
            -- A waiter whose gateway no one hears (`hears`: it died) is dropped like one past
            -- its deadline, and the permit goes to the next waiter.
            if deadline >= now and gateway_alive(gw) and (gw == MY_GW or gw == CALLER or hears(gw)) then
              -- No longer than the gateway's liveness: one that stalled with waiters queued is
              -- known dead only one TTL after its last sync, and a grant to it must not hold
              -- the permit a full TTL beyond that (a live gateway's next sync renews it).
              local ep = lease(head, c, gw, seq, LIVE_UNTIL[gw], size)
              if gw == MY_GW then  -- the caller's own waiter: in the reply, no message
                table.insert(MINE, head) table.insert(MINE, ep)
              else
                notify(gw, S.pool .. '|' .. head .. '|' .. ep)
              end
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
  if DUE == nil then DUE = num(state().due, -1) end
  if DUE >= 0 and now < DUE then return end  -- nothing can have expired yet
  local expired = redis.call('ZRANGEBYSCORE', K.leases, '-inf', NOW_S, 'LIMIT', 0, 200)
  for _, ticket in ipairs(expired) do drop_lease(ticket, true) end
  local abandoned = redis.call('ZRANGEBYSCORE', K.qdl, '-inf', now - WAITER_GRACE_MS, 'LIMIT', 0, 200)
  for _, ticket in ipairs(abandoned) do
    local meta = redis.call('HGET', K.qmeta, ticket)
    if meta then unqueue(ticket, meta) else redis.call('ZREM', K.qdl, ticket) end
  end
  local dead = redis.call('ZRANGEBYSCORE', K.gws, '-inf', NOW_S, 'LIMIT', 0, 20)
  if #dead > 0 then
    local is_dead = {}
    for _, gw in ipairs(dead) do is_dead[gw] = true ALIVE[gw] = false REG[gw] = nil end
    local all = redis.call('HGETALL', K.qmeta)
    for i = 1, #all, 2 do
      local _, _, gw = parse_qmeta(all[i + 1])
      if all[i] ~= PAD_FIELD and is_dead[gw] then unqueue(all[i], all[i + 1]) end
    end
    redis.call('ZREM', K.gws, unpack(dead))
    local st = state()
    for _, gw in ipairs(dead) do
      redis.call('HDEL', K.state, 'hw:' .. gw, 'bx:' .. gw, 'pl:' .. gw)
      st['hw:' .. gw], ST_DIRTY['hw:' .. gw] = nil, nil
      st['bx:' .. gw], ST_DIRTY['bx:' .. gw] = nil, nil
    end
    LIVE = nil
    redis.call('SREM', K.creditors, unpack(dead))
  end
  local due = math.huge
  for _, z in ipairs({{K.leases, 0}, {K.qdl, WAITER_GRACE_MS}, {K.gws, 0}}) do
    local first = redis.call('ZRANGE', z[1], 0, 0, 'WITHSCORES')
    if first[2] then due = math.min(due, tonumber(first[2]) + z[2]) end
  end
  DUE = due == math.huge and -1 or due
  set_state('due', intstr(DUE))
end

-- Tell every gateway holding credits to hand its idle ones back (see `acquire`).
local function recall_credits()
  if NO_CREDITORS then return end
  NO_CREDITORS = true
  local creditors = redis.call('SMEMBERS', K.creditors)
  if #creditors == 0 then return end
  for _, creditor in ipairs(creditors) do notify(creditor, S.pool .. '|!return|') end
  redis.call('DEL', K.creditors)
end

-- This gateway's position among the live ones, and how many there are (degraded shares).
local function gateway_rank(gw)
  local live = redis.call('ZRANGEBYSCORE', K.gws, NOW_EXCL_S, '+inf')
  table.sort(live)
  for i, g in ipairs(live) do if g == gw then return i - 1, #live end end
  return -1, #live
end

-- Milliseconds until the deadline of class c's oldest and newest waiter (0 when none).
-- Kept in EDGE for the rest of the call: a waiter queued later at the end of the fair order
-- is the new tail (put_waiter forgets the edges of one placed ahead of others), a granted head
-- leaves the tail as it is (grant_loop), any other waiter leaving forgets the class's edges.
local function edges_left(c)
  local e = EDGE[c]
  if e == nil then
    e = false
    local head = redis.call('ZRANGEBYSCORE', K.queue, CLASS_LO[c], CLASS_HI[c], 'LIMIT', '0', '1')[1]
    if head then
      local tail = redis.call('ZREVRANGEBYSCORE', K.queue, CLASS_HI[c], CLASS_LO[c], 'LIMIT', '0', '1')[1]
      local metas = redis.call('HMGET', K.qmeta, head, tail)
      e = {0, 0}
      for i = 1, 2 do
        if metas[i] then
          local _, deadline = parse_qmeta(metas[i])
          e[i] = deadline
        end
      end
    end
    EDGE[c] = e
  elseif e and e[1] == nil then  -- the head was granted in this call (grant_loop): read the new one
    local head = redis.call('ZRANGEBYSCORE', K.queue, CLASS_LO[c], CLASS_HI[c], 'LIMIT', '0', '1')[1]
    if head then
      local meta = redis.call('HGET', K.qmeta, head)
      local _, deadline = 0, 0
      if meta then _, deadline = parse_qmeta(meta) end
      e[1] = deadline or 0
    else
      e = false
      EDGE[c] = e
    end
  end
  if not e then return 0, 0 end
  return math.max(0, e[1] - now), math.max(0, e[2] - now)
end

-- Small integers as the snapshot writes them, kept for the library's life: string.format
-- runs one sprintf per field (23 per snapshot, ~8 % of a contended decision's instructions).
local ISTR = {}
local function istr(n)
  local v = string.format('%d', n)
  if n >= -1 and n < 4096 and n == math.floor(n) then ISTR[n] = v end
  return v
end

-- The state the processor's policy decides a refused request on (PoolStatus.from_reply). In a
-- batch only the first snapshot is whole (`snap`); each later one (`snapo`) carries only what
-- is the op's own: in-flight and queued per class at the op's turn, its tenant's waiters, its
-- place in its class (`ahead`) and its class's grant rate. The rest (limit, pool rates, level, gateways, endpoints, queue edges)
-- is read from the call's whole snapshot (schema.expand_snapshots): the same `now`, at most a
-- few of the call's own events older. Building it per op cost ~20 % of a contended decision's
-- instructions in a call of 6 (the edges' reads and the 23-field string).
local function snapshot(out, c, tenant, gw)
  local inflight, queued = counts()
  local tq, class_rate, ahead = 0, 0, 0
  if c then
    ahead = queued[c]  -- (the fair order off: arrival order, all of them)
    local named_next
    if tenant ~= '' then
      local r = redis.call('HMGET', K.counts, 't' .. CLS[c] .. ':' .. tenant, flow_field(c, tenant))
      tq, named_next = num(r[1], 0), r[2]
    end
    class_rate = read_rate(GRATE[c])
    -- Its class's waiters ahead of it (policy.Snapshot.ahead): at least the ones whose tag is
    -- at most the one it would get (all of them when that is past every tag given: one flow
    -- alone, arrival order, no command). A flow with waiters is also passed by the later
    -- arrivals of flows with fewer: with every flow as backlogged as its own, each flow has as
    -- many ahead of it as it has waiters (own x flows, at most the whole queue). A flow with no
    -- waiter joins the next round, where no later arrival passes it.
    if queued[c] > 0 and S.fair then
      local tag = next_tag(c, tenant, named_next)
      if tag <= fair().t[c] then
        ahead = redis.call('ZCOUNT', K.queue, CLASS_LO[c], '(' .. intstr((c - 1) * CLASS_SPAN + tag % CLASS_SPAN + 1))
        local anon = math.max(0, queued[c] - NQ[c])
        local own = tenant ~= '' and tq or anon
        local flows = NF[c] + (anon > 0 and 1 or 0)
        ahead = math.max(ahead, math.min(queued[c], own * flows))
      end
    end
  end
  if CALL_SNAP then
    table.insert(out, 'snapo')
    table.insert(out, 'i0 ' .. (ISTR[inflight[1]] or istr(inflight[1])) ..
      ' i1 ' .. (ISTR[inflight[2]] or istr(inflight[2])) .. ' i2 ' .. (ISTR[inflight[3]] or istr(inflight[3])) ..
      ' q0 ' .. (ISTR[queued[1]] or istr(queued[1])) .. ' q1 ' .. (ISTR[queued[2]] or istr(queued[2])) ..
      ' q2 ' .. (ISTR[queued[3]] or istr(queued[3])) .. ' tenant_queued ' .. (ISTR[tq] or istr(tq)) ..
      ' class_rate ' .. (ISTR[class_rate] or string.format('%.14g', class_rate)) ..
      ' ahead ' .. (ISTR[ahead] or istr(ahead)))
    return out
  end
  if MY_GW then CALL_SNAP = true end
  local L = int_limit(false)
  local rank, live = -1, nil
  if gw then
    rank, live = gateway_rank(gw)
  else
    if not LIVE then LIVE = redis.call('ZCOUNT', K.gws, NOW_EXCL_S, '+inf') end
    live = LIVE
  end
  n_active()
  local _, _, _, rate_n = unpack_rate('rate:p')
  if not LVL_S then LVL_S = string.match(state()['lvl:p'] or '', '^([^|]*)|') or '0' end
  local lvl = LVL_S
  -- For early drop (policy.wait_estimate): how much the rate rests on (rate_n), the in-flight
  -- level it was measured at (lvl), and the head/tail deadlines of each class queue (hl, tl).
  local e = {0, 0, 0, 0, 0, 0}
  for k = 1, 3 do
    if queued[k] > 0 then e[2 * k - 1], e[2 * k] = edges_left(k) end
  end
  -- One reply field of space-separated names and values (schema.parse_fields splits it): a
  -- reply of 60 elements costs more to build than the commands above.
  table.insert(out, 'snap')
  local rate, epoch = read_rate('rate:p'), S and S.epoch or -1
  -- Prefill pacing (while a P0 is in flight): ms until the least endpoint estimate is down to
  -- `pf_k`, when a paced request may be granted (policy.wait_estimate counts the wait from it).
  -- `pfb`: the tokens above the pace level summed over the endpoints (what must drain before
  -- each endpoint's first paced grant: fewer grants than the least's wait alone suggests).
  local pfw, pfb = 0, 0
  if inflight[1] > 0 and S and pf_on() then
    local pf = pf_read()
    if #pf.eps > 0 then
      local least = math.huge
      for _, ep in ipairs(pf.eps) do
        local v = pf.lv[ep]
        least = math.min(least, v)
        if v > S.pf_k then pfb = pfb + v - S.pf_k end
      end
      pfw = math.max(0, math.ceil((least - S.pf_k) / S.pf_rate_ms))
      pfb = math.ceil(pfb)
    end
  end
  -- One concatenation (a single VM instruction); numbers as strings (`..` of a number is a sprintf).
  -- `%d` of each field before: the integer part (the fields are integers; rates keep 14 digits).
  table.insert(out, 'limit ' .. (ISTR[L] or istr(L)) .. ' i0 ' .. (ISTR[inflight[1]] or istr(inflight[1])) ..
    ' i1 ' .. (ISTR[inflight[2]] or istr(inflight[2])) .. ' i2 ' .. (ISTR[inflight[3]] or istr(inflight[3])) ..
    ' q0 ' .. (ISTR[queued[1]] or istr(queued[1])) .. ' q1 ' .. (ISTR[queued[2]] or istr(queued[2])) ..
    ' q2 ' .. (ISTR[queued[3]] or istr(queued[3])) .. ' tenant_queued ' .. (ISTR[tq] or istr(tq)) ..
    ' rate ' .. (ISTR[rate] or string.format('%.14g', rate)) ..
    ' class_rate ' .. (ISTR[class_rate] or string.format('%.14g', class_rate)) ..
    ' gateways ' .. (ISTR[live] or istr(live)) .. ' rank ' .. (ISTR[rank] or istr(rank)) .. ' now ' .. NOW_S ..
    ' active ' .. (ISTR[NACTIVE] or istr(NACTIVE)) .. ' epoch ' .. (ISTR[epoch] or istr(epoch)) ..
    ' rate_n ' .. (ISTR[rate_n] or istr(rate_n)) .. ' lvl ' .. lvl ..
    ' hl0 ' .. (ISTR[e[1]] or istr(e[1])) .. ' hl1 ' .. (ISTR[e[3]] or istr(e[3])) .. ' hl2 ' .. (ISTR[e[5]] or istr(e[5])) ..
    ' tl0 ' .. (ISTR[e[2]] or istr(e[2])) .. ' tl1 ' .. (ISTR[e[4]] or istr(e[4])) .. ' tl2 ' .. (ISTR[e[6]] or istr(e[6])) ..
    ' pfw ' .. (ISTR[pfw] or istr(pfw)) .. ' pfb ' .. (ISTR[pfb] or istr(pfb)) ..
    (c and ' ahead ' .. (ISTR[ahead] or istr(ahead)) or '') .. ' n0 ' .. (ISTR[NQ[1]] or istr(NQ[1])) ..
    ' n1 ' .. (ISTR[NQ[2]] or istr(NQ[2])) .. ' n2 ' .. (ISTR[NQ[3]] or istr(NQ[3])))
  return out
end

-- acquire's decision: lease now if the grant loop would give this class the next permit.
-- Returns the short grant reply, or nil (refused; idle credits elsewhere are recalled).
--
-- Credits: while nothing waits and the pool is at most half full, a grant may come with up
-- to `wanted` extra leases the gateway admits later requests with, without a round trip.
-- They are ordinary leases (counted in-flight, renewed, reclaimed), so in-flight never
-- exceeds the limit; a queue forming tells every creditor to return its idle ones.
local function try_lease(ticket, gw, seq, c, wanted, size)
  reclaim()
  grant_loop()
  if held() then return nil end  -- waits in the queue for the hold's end (a refusal, not a drop)
  local L = int_limit(true)
  local inflight, queued = counts()
  local ok = eligible(c, L, inflight, queued)
  if ok then
    for k = 1, c do
      if queued[k] > 0 and eligible(k, L, inflight, queued) then ok = false end
    end
  end
  if ok then ok = ramp_open(c, inflight) and pf_open(c, inflight) end
  if not ok then
    recall_credits()  -- a request could not be admitted: idle credits elsewhere must come back
    return nil
  end
  local before = inflight[1] + inflight[2] + inflight[3]
  local ep = lease(ticket, c, gw, seq, nil, size)
  local credits = {}
  if wanted > 0 and not S.picking and queued[1] + queued[2] + queued[3] == 0 then
    local n = math.min(wanted, math.floor(L / 2) - (before + 1))
    if RAMP and inflight[1] > 0 then n = math.min(n, math.floor(RAMP[1])) end  -- credits admit any class later
    ramp_take(math.max(0, n))
    for i = 1, n do
      local credit = ticket .. ':c' .. i
      put_lease(credit, 1, gw, seq, '')
      table.insert(credits, credit)
    end
    if n > 0 then redis.call('SADD', K.creditors, gw) NO_CREDITORS = false end
  end
  return {'granted', 'g', 'endpoint', ep, 'credits', table.concat(credits, ',')}
end

-- enqueue's cap check and insertion (c 1-based); returns the cap that refused it, or nil.
-- A gateway that has not synced yet (first call after a Redis restart) is registered; a
-- registered one is not refreshed here: only `sync` proves a gateway alive.
local function try_queue(ticket, gw, seq, c, tenant, deadline, new, size)
  if not new and redis.call('HEXISTS', K.qmeta, ticket) == 1 then return nil end
  local _, queued = counts()
  if queued[c] >= S.maxq[c] then return 'queue_full' end
  if tenant ~= '' then
    local tq = num(redis.call('HGET', K.counts, 't' .. CLS[c] .. ':' .. tenant), 0)
    if tq >= S.tcap[c] then return 'tenant_cap' end
  end
  if ALIVE[gw] ~= true and not REG[gw] then
    if redis.call('ZADD', K.gws, 'NX', EXPIRY_S, gw) == 1 then
      lower_due(now + ttl)
      LIVE = nil
      ALIVE[gw], LIVE_UNTIL[gw] = true, now + ttl
    end
    REG[gw] = true  -- registered (alive or not): the next waiter of this call needs no ZADD NX
  end
  put_waiter(ticket, c - 1, deadline, gw, seq, tenant, size)
  return nil
end

-- `hw:<gateway>` in the state hash: the highest ticket number of that gateway that an admit,
-- acquire or enqueue has seen (or below which its sync re-asserted entries). A ticket above it
-- is new: it cannot be leased or queued yet, so the idempotency checks (which only a retried
-- call needs) are skipped. Written in the same atomic call as the entries, so a promoted
-- replica has both or neither; unknown (nil) means check. Dropped with a dead gateway.
local function is_new(gw, seq)
  local f = 'hw:' .. gw
  local st = state()
  local hw = st[f]
  if hw == nil and gw ~= MY_GW then hw = redis.call('HGET', K.state, f) or false st[f] = hw end
  local n = seq + 0
  local above = hw and n > hw + 0
  if not hw or above then set_state(f, seq) end
  return above
end

local function short_if_leased(ticket)
  if redis.call('ZSCORE', K.leases, ticket) then
    return {'granted', 'g', 'endpoint', redis.call('HGET', K.lep, ticket) or '', 'credits', ''}
  end
  return nil
end

local OPS = {}

function OPS.configure(ARGV)
  -- ARGV 3 pool, 4.. field/value pairs of schema.PoolSettings (with `epoch`). Stores them when
  -- the pool has none or these carry a higher epoch; returns what is stored afterwards.
  local mine = {}
  for i = 4, #ARGV, 2 do mine[ARGV[i]] = ARGV[i + 1] end
  local stored = redis.call('HGET', K.settings, 'epoch')
  if not stored or tonumber(mine.epoch) > tonumber(stored) then
    redis.call('DEL', K.settings)
    local t = redis.call('TIME')  -- a new stamp: every script's settings cache reloads
    redis.call('HSET', K.settings, 'pool', ARGV[3], 'stamp', t[1] .. '.' .. t[2], unpack(ARGV, 4))
  end
  return redis.call('HGETALL', K.settings)
end

function OPS.acquire(ARGV)
  -- ARGV 3 ticket, 4 gateway, 5 seq, 6 class, 7 tenant, 8 credits wanted, 9 (optional) the
  -- request's prompt tokens (prefill estimate; absent: pf_size): lease now if the grant loop
  -- would. The hot path: a short reply {granted=g, endpoint, credits} on a grant, the full
  -- snapshot only when the policy has to decide. Idempotent: a retried acquire of a ticket
  -- already leased returns that lease.
  local ticket, gw, seq, c, tenant = ARGV[3], ARGV[4], ARGV[5], (CLASS0[ARGV[6]] or tonumber(ARGV[6])) + 1, ARGV[7]
  local new = is_new(gw, seq)
  ramp_refill()
  local got = (not new and short_if_leased(ticket)) or
    try_lease(ticket, gw, seq, c, tonumber(ARGV[8] or '0') or 0, size_arg(ARGV[9]))
  if got then return got end
  return snapshot({'granted', '0'}, c, tenant, nil)
end

function OPS.admit(ARGV)
  -- acquire, and when refused, enqueue in the same call: one call per contended request.
  -- ARGV 3 ticket, 4 gateway, 5 seq, 6 class, 7 tenant, 8 credits wanted, 9 timeout (ms), 10
  -- (optional) the request's prompt tokens (as `acquire`; kept with the waiter).
  -- Refused: the snapshot as `acquire` returns it (the state the policy decides on, before
  -- this waiter joined), and `queued` 1 when it was queued, or `rejected` with the cap that
  -- refused it. The caller whose policy then rejects the request cancels the waiter. With
  -- endpoint picking and no active endpoint it is not queued (the caller answers 503).
  -- Nothing becomes grantable by queueing a waiter (the grant loop just ran and a waiter only
  -- adds to what others must leave free), so there is no second grant loop. Idempotent.
  local ticket, gw, seq, c, tenant = ARGV[3], ARGV[4], ARGV[5], (CLASS0[ARGV[6]] or tonumber(ARGV[6])) + 1, ARGV[7]
  local new = is_new(gw, seq)
  ramp_refill()
  local size = size_arg(ARGV[10])
  local got = (not new and short_if_leased(ticket)) or try_lease(ticket, gw, seq, c, (ARGV[8] or 0) + 0, size)
  if got then return got end
  local out = snapshot({'granted', '0'}, c, tenant, nil)
  if S.picking and NACTIVE == 0 then
    table.insert(out, 'queued') table.insert(out, '0')
    return out
  end
  local why = try_queue(ticket, gw, seq, c, tenant, now + ARGV[9], new, size)
  table.insert(out, why and 'rejected' or 'queued')
  table.insert(out, why or '1')
  return out
end

function OPS.enqueue(ARGV)
  -- ARGV 3 ticket, 4 gateway, 5 seq, 6 class, 7 tenant, 8 timeout (ms), 9 (optional) the
  -- request's prompt tokens (as `acquire`). The class's max_queue and the tenant cap are
  -- checked here, atomically (`rejected`). Idempotent: a ticket already queued or leased is not
  -- added again.
  local ticket, gw, seq, c, tenant = ARGV[3], ARGV[4], ARGV[5], (CLASS0[ARGV[6]] or tonumber(ARGV[6])) + 1, ARGV[7]
  local new = is_new(gw, seq)
  ramp_refill()
  reclaim()
  if not new and redis.call('ZSCORE', K.leases, ticket) then
    return snapshot({'granted', '1', 'endpoint', redis.call('HGET', K.lep, ticket) or ''}, c, tenant, nil)
  end
  local why = try_queue(ticket, gw, seq, c, tenant, now + tonumber(ARGV[8]), new, size_arg(ARGV[9]))
  if why then return snapshot({'granted', '0', 'rejected', why}, c, tenant, nil) end
  recall_credits()
  grant_loop()
  local mine = redis.call('ZSCORE', K.leases, ticket) and '1' or '0'
  return snapshot({'granted', mine, 'endpoint', redis.call('HGET', K.lep, ticket) or ''}, c, tenant, nil)
end

function OPS.cancel(ARGV)
  -- ARGV 3 ticket. 0 = was queued, now removed; 1 = already granted (caller owns a permit);
  -- 2 = neither (its lease was reclaimed, or it was reaped).
  local ticket = ARGV[3]
  local meta = redis.call('HGET', K.qmeta, ticket)
  if meta then unqueue(ticket, meta) return 0 end
  if redis.call('ZSCORE', K.leases, ticket) then return 1 end
  return 2
end

function OPS.release(ARGV)
  -- ARGV 3.. tickets. Returns how many were held (a missing one was reclaimed already).
  ramp_refill()
  local released = 0
  for i = 3, #ARGV do
    if drop_lease(ARGV[i], true) then released = released + 1 end
  end
  reclaim()
  grant_loop()
  return released
end

function OPS.refund(ARGV)
  -- ARGV 3 endpoint, 4 prompt tokens: a request routed there ended unprefilled (no answer from
  -- it: its body never came; or refused, 4xx/5xx: prefill.unprefilled, the processor's): its
  -- size leaves that endpoint's estimate, never below 0 (prefill.PrefillEstimate.refunded). Without it a header claiming a 48 KB body and
  -- closed at once held lower classes back behind 8,192 tokens of prefill that never came (a
  -- review). Sent before the request's release in the same batch, whose grant loop then sees it.
  local ep, size = ARGV[3], size_arg(ARGV[4])
  if not ep or not size or size <= 0 or not pf_on() then return 0 end
  local l, ts = string.match(redis.call('HGET', K.epfill, ep) or '', '^([^|]*)|([^|]*)$')
  l, ts = tonumber(l or ''), tonumber(ts or '')
  if not l or not ts then return 0 end
  local v = math.max(0, math.max(0, l - S.pf_rate_ms * math.max(0, now - ts)) - size)
  redis.call('HSET', K.epfill, ep, string.format('%.17g|%d', v, now))
  if PF and PF.lv[ep] then PF.lv[ep] = v end
  return 1
end

function OPS.credit_done(ARGV)
  -- ARGV 3: requests admitted from this gateway's idle credits that completed since its last
  -- report. Their credits went back to the gateway, not here, so no release counted them: the
  -- release rate (and the in-flight level) early drop and Retry-After divide by missed them (a
  -- review: 0.00/s read against 10/s of completions, and P1 early-dropped after a load step).
  local n = math.floor(tonumber(ARGV[3]) or 0)
  if n <= 0 then return 0 end
  n = math.min(n, 100000)
  bump_level()
  bump_rate('rate:p', n)
  return n
end

function OPS.return_credits(ARGV)
  -- ARGV 3.. idle credit tickets handed back unused: not completions, so no rate event.
  ramp_refill()
  for i = 3, #ARGV do drop_lease(ARGV[i], false) end
  grant_loop()
  return 0
end

function OPS.sync(ARGV)
  -- The gateway re-asserts everything it has: ARGV 3 gateway, 4 watermark (its next ticket
  -- number), 5 number of held entries, then held "ticket|class|seq|endpoint", then waiting
  -- "ticket|class|seq|remaining_ms|tenant". Afterwards Redis holds exactly that for this
  -- gateway: held leases are extended (re-created if Redis lost them: the requests are live),
  -- waiters missing from the queue are put back, and this gateway's leases and waiters that it
  -- did not assert and that are older than the watermark (abandoned calls that ran late, or
  -- leftovers of an outage) are dropped. Proves the gateway alive for one TTL.
  local gw, watermark, nheld = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  CALLER = gw
  -- A count that is not a number (written by something else) fails every call that reads the
  -- counts: dropped here (before this call reads them), and recounted below like any other.
  if not INF then
    local cv = redis.call('HMGET', K.counts, unpack(COUNT_FIELDS))
    for i = 1, #COUNT_FIELDS do
      if cv[i] and not tonumber(cv[i]) then redis.call('HDEL', K.counts, COUNT_FIELDS[i]) end
    end
  end
  -- A per-endpoint count that is not an integer (written by something else) fails every
  -- HINCRBY on it, and with it every call that grants to or releases from that endpoint: the
  -- processors fell back to local limits for good. The renewal drops it (its count restarts).
  local epc = redis.call('HGETALL', K.epinf)
  for i = 1, #epc, 2 do
    if not string.match(epc[i + 1], '^%-?%d+$') then redis.call('HDEL', K.epinf, epc[i]) end
  end
  ramp_refill()
  redis.call('ZADD', K.gws, EXPIRY_S, gw)
  redis.call('HSET', K.lmeta, PAD_FIELD, PAD)  -- hashtables from now on (see PAD)
  redis.call('HSET', K.qmeta, PAD_FIELD, PAD)
  set_state(PAD_FIELD, PAD)
  for _, z in ipairs({K.leases, K.queue, K.qdl}) do  -- skiplists from now on (see ZSET_PAD_MIN)
    if redis.call('ZCARD', z) >= ZSET_PAD_MIN then
      redis.call('ZADD', z, '0', PAD)
      redis.call('ZREM', z, PAD)
    end
  end
  lower_due(now + ttl)
  ALIVE[gw], LIVE_UNTIL[gw] = true, now + ttl
  LIVE = nil
  is_new(gw, tostring(watermark - 1))  -- every entry it re-asserts is below its watermark
  local held, waiting = {}, {}
  local reasserted, requeued, dropped = 0, 0, 0
  for i = 6, 5 + nheld do
    local t, c, seq, ep = string.match(ARGV[i], '^([^|]*)|(%d)|(%d+)|(.*)$')
    held[t] = true
    if redis.call('ZADD', K.leases, 'XX', 'CH', EXPIRY_S, t) == 0 and not redis.call('ZSCORE', K.leases, t) then
      local meta = redis.call('HGET', K.qmeta, t)
      if meta then unqueue(t, meta) end
      put_lease(t, tonumber(c), gw, seq, ep)
      reasserted = reasserted + 1
    end
  end
  for i = 6 + nheld, #ARGV do
    local t, c, seq, remaining, tenant = string.match(ARGV[i], '^([^|]*)|(%d)|(%d+)|(%d+)|(.*)$')
    waiting[t] = true
    if redis.call('ZSCORE', K.leases, t) then
      -- Granted while this renewal was on its way: renewed like a held permit. Left at the
      -- gateway's previous liveness, the lease ran out under the live request if the next
      -- renewal came late, and its permit went to another gateway (2 of limit 1).
      redis.call('ZADD', K.leases, 'XX', EXPIRY_S, t)
      -- And told in the reply, as a grant the batch made: its message may never come (a
      -- connection cut around a failover or a slot move while Redis still counted it, a batch
      -- reply lost and the batch sent again). Only the poll told it before; with
      -- `poll_interval_s` raised, a pool stalled 14 s with every permit leased to such waiters,
      -- each renewal extending them. A second report of one already started is ignored.
      if MINE and gw == MY_GW then
        table.insert(MINE, t) table.insert(MINE, redis.call('HGET', K.lep, t) or '')
      end
    elseif not redis.call('ZSCORE', K.queue, t) then
      -- Missing from the queue (lost, or its key was): queued again. One whose meta survived
      -- (the queue key alone lost) was passed over by every grant until its deadline.
      local meta = redis.call('HGET', K.qmeta, t)
      if meta then unqueue(t, meta) end
      put_waiter(t, tonumber(c), now + tonumber(remaining), gw, seq, tenant)
      requeued = requeued + 1
    end
  end
  -- This gateway's entries nobody holds any more are dropped; every other entry is counted:
  -- the counts the calls keep by increments are recounted below from what they count.
  local inf, que, per = {0, 0, 0}, {0, 0, 0}, {}
  local all = redis.call('HGETALL', K.lmeta)
  local metas = 0
  for i = 1, #all, 2 do
    local t = all[i]
    local c, lgw, seq = parse_lmeta(all[i + 1])
    if t ~= PAD_FIELD and lgw == gw and tonumber(seq) < watermark and not held[t] and not waiting[t] then
      drop_lease(t, false)
      dropped = dropped + 1
    elseif t ~= PAD_FIELD then
      inf[c + 1], metas = inf[c + 1] + 1, metas + 1
    end
  end
  if metas ~= redis.call('ZCARD', K.leases) then
    -- Leases without their meta, or metas without their lease (a key lost or written by
    -- something else): count the leases, those without a meta as their release counts them.
    inf = {0, 0, 0}
    for _, t in ipairs(redis.call('ZRANGE', K.leases, 0, -1)) do
      local c = parse_lmeta(redis.call('HGET', K.lmeta, t))
      inf[c + 1] = inf[c + 1] + 1
    end
  end
  all = redis.call('HGETALL', K.qmeta)
  for i = 1, #all, 2 do
    local t = all[i]
    local c, _, qgw, seq, tenant = parse_qmeta(all[i + 1])
    if t ~= PAD_FIELD and qgw == gw and tonumber(seq) < watermark and not waiting[t] then
      unqueue(t, all[i + 1])
      dropped = dropped + 1
    elseif t ~= PAD_FIELD and c then
      que[c + 1] = que[c + 1] + 1
      if tenant ~= '' then
        local f = 't' .. CLS[c + 1] .. ':' .. tenant
        per[f] = (per[f] or 0) + 1
      end
    end
  end
  -- In-flight and queued per class, waiters per tenant, and (for the fair order) the waiters
  -- with a tenant and the tenants waiting per class. Kept by increments, a count never repaired
  -- itself: one lost (the counts hash deleted or evicted, a value written by something else)
  -- let the pool run past its limit for good (a review: 8 upstream at limit 4 after a DEL), and
  -- an older version's grant loop leaves the fair order's behind (a rolling upgrade). The next
  -- tags of tenants no longer waiting are dropped too.
  counts()
  local recounted = 0
  local nq, nf = {0, 0, 0}, {0, 0, 0}
  for f, n in pairs(per) do
    local k = CLASS0[string.sub(f, 2, 2)] + 1
    nq[k], nf[k] = nq[k] + n, nf[k] + 1
  end
  local cf = redis.call('HGETALL', K.counts)
  local seen = {}
  for i = 1, #cf, 2 do
    local kind, c1, rest = string.match(cf[i], '^([tf])(%d):(.*)$')
    if kind == 't' then
      local n = per[cf[i]]
      seen[cf[i]] = true
      if n == nil or n ~= tonumber(cf[i + 1]) then  -- (no waiter: whatever it holds, a number or not)
        recounted = recounted + 1
        if n then redis.call('HSET', K.counts, cf[i], n) else redis.call('HDEL', K.counts, cf[i]) end
      end
    elseif kind == 'f' and (not per['t' .. c1 .. ':' .. rest] or not string.match(cf[i + 1], '^%d+$')) then
      redis.call('HDEL', K.counts, cf[i])  -- no waiter left, or no tag: the flow joins the next round
    end
  end
  for f, n in pairs(per) do  -- tenants waiting whose count was lost
    if not seen[f] then
      redis.call('HSET', K.counts, f, n)
      recounted = recounted + 1
    end
  end
  for k = 1, 3 do
    if inf[k] ~= INF[k] or que[k] ~= QUE[k] then
      recounted = recounted + 1
      INF[k], QUE[k], CNT_DIRTY = inf[k], que[k], true
    end
    if nq[k] ~= NQ[k] or nf[k] ~= NF[k] then NQ[k], NF[k], CNT_DIRTY = nq[k], nf[k], true end
  end
  -- Permits per endpoint, from the endpoint each lease was routed to (picking).
  if redis.call('EXISTS', K.lep) == 1 or redis.call('EXISTS', K.epinf) == 1 then
    local per_ep = {}
    local lep = redis.call('HGETALL', K.lep)
    for i = 1, #lep, 2 do
      if redis.call('ZSCORE', K.leases, lep[i]) then
        per_ep[lep[i + 1]] = (per_ep[lep[i + 1]] or 0) + 1
      else  -- the route of a lease that is gone (lost with the leases key, say)
        redis.call('HDEL', K.lep, lep[i])
      end
    end
    local ep = redis.call('HGETALL', K.epinf)
    for i = 1, #ep, 2 do
      if per_ep[ep[i]] ~= tonumber(ep[i + 1]) then
        recounted = recounted + 1
        if per_ep[ep[i]] then redis.call('HSET', K.epinf, ep[i], per_ep[ep[i]]) else redis.call('HDEL', K.epinf, ep[i]) end
      end
      per_ep[ep[i]] = nil
    end
    for e, n in pairs(per_ep) do
      redis.call('HSET', K.epinf, e, n)
      recounted = recounted + 1
    end
  end
  -- Sizes of waiters that left without taking theirs (popped by an older version's grant loop,
  -- or queued while the estimate was on and gone after it was turned off): more sizes than
  -- waiters means some are stale.
  if redis.call('HLEN', K.qsize) > redis.call('ZCARD', K.queue) then
    for _, t in ipairs(redis.call('HKEYS', K.qsize)) do
      if redis.call('HEXISTS', K.qmeta, t) == 0 then redis.call('HDEL', K.qsize, t) end
    end
  end
  hold_synced(gw)
  reclaim()
  grant_loop()
  return snapshot({'granted', '0', 'reasserted', reasserted, 'requeued', requeued, 'dropped', dropped,
                   'recounted', recounted}, nil, nil, gw)
end

function OPS.mine(ARGV)
  -- ARGV 3.. tickets a gateway is waiting on: the poll fallback for lost grant messages. The
  -- reply pairs each leased one with its endpoint. With ARGV 3 '!gone' (processors that know
  -- it), a ticket neither leased nor queued is paired with '!gone': Redis dropped it (its
  -- gateway was not heard when its turn came, or a failover lost it); the gateway re-queues it.
  -- With ARGV 3 '!deaf', ARGV 4 the gateway and 5 a duration (ms): as '!gone', and the gateway
  -- cannot subscribe: it is heard by its polls for that long (`hears`).
  ramp_refill()
  local leased, first = {}, 3
  local gone = ARGV[3] == '!gone' or ARGV[3] == '!deaf'
  if ARGV[3] == '!deaf' then
    redis.call('HSET', K.state, 'pl:' .. ARGV[4], intstr(now + tonumber(ARGV[5])))
    first = 6
  elseif gone then
    first = 4
  end
  -- The poll's gateway (its tickets are `<gateway>/<seq>`), calling with its own liveness run
  -- out and its fence still here: the clock jumped, as a batch finds it (OPS.batch). A poll
  -- is sent on its own, and came first after a jump in a review: its reclaim expired every
  -- fence and lease and its grant loop granted on top (13 and 11 in flight of L 8).
  local gw = ARGV[first] and string.match(ARGV[first], '^(.+)/[^/]+$')
  if gw and gateway_lapsed(gw) and redis.call('HEXISTS', K.state, 'bx:' .. gw) == 1 and not held() then
    start_hold(true)
  end
  reclaim()
  grant_loop()
  for i = first, #ARGV do
    if redis.call('ZSCORE', K.leases, ARGV[i]) then
      table.insert(leased, ARGV[i])
      table.insert(leased, redis.call('HGET', K.lep, ARGV[i]) or '')
    elseif gone and redis.call('HEXISTS', K.qmeta, ARGV[i]) == 0 then
      table.insert(leased, ARGV[i])
      table.insert(leased, '!gone')
    end
  end
  return leased
end

function OPS.set_limit(ARGV)
  -- ARGV 3 expected version, 4 limit, 5 rtt_noload, 6 probe_count, 7 probe_jitter, 8 the rest
  -- of the limiter state (opaque here: vegas.py's baseline bookkeeping).
  -- Compare-and-set: the Vegas arithmetic stays in Python (vegas.py), atomic here.
  limit_value(true)
  local version = num(state().version, 0)
  if version ~= tonumber(ARGV[3]) then return {'ok', '0', 'version', tostring(version)} end
  ramp_refill()  -- accrued at the old limit up to now
  local credit, credit_ms = tonumber(ARGV[9] or '0'), tonumber(ARGV[10] or '0')
  if credit >= 1 and credit_ms > 0 and S.ramp_rate_ms > 0 then  -- endpoints turned active (ramp_extra)
    RAMPX = {ramp_extra() + credit, now + credit_ms}
    set_state('ramp:x', '')  -- flush formats it
  end
  set_state('limit', ARGV[4])
  set_state('rtt_noload', ARGV[5])
  set_state('probe_count', ARGV[6])
  set_state('probe_jitter', ARGV[7])
  set_state('vegas_x', ARGV[8] or '')
  set_state('version', tostring(version + 1))
  grant_loop()
  return {'ok', '1', 'version', tostring(version + 1)}
end

function OPS.eject(ARGV)
  -- ARGV 3 endpoint, 4 milliseconds: the pick and the prefill pacing leave the endpoint out
  -- until then (a longer ejection already stored stands). Only active endpoints are kept (one
  -- not active is not picked anyway: 0 is returned), ended ones are dropped, and at most
  -- EJECT_MAX: this one and the latest-ending others. Returns the ms it is ejected for.
  local ep, dur = ARGV[3] or '', tonumber(ARGV[4] or '')
  if ep == '' or string.find(ep, '[|%s]') or not dur or dur <= 0 or dur ~= dur or dur == math.huge then
    return redis.error_reply('ERR eject: bad endpoint or duration')
  end
  local active = {}
  for _, e in ipairs(redis.call('SMEMBERS', K.active)) do active[e] = true end
  local until_ms = now + math.floor(dur)
  local keep = {}
  for _, x in ipairs(ejections()) do
    if x[1] == ep then until_ms = math.max(until_ms, x[2]) elseif active[x[1]] then keep[#keep + 1] = x end
  end
  if #keep >= EJECT_MAX then
    table.sort(keep, function(a, b) return a[2] > b[2] end)
    for i = #keep, EJECT_MAX, -1 do keep[i] = nil end
  end
  if active[ep] then keep[#keep + 1] = {ep, until_ms} end
  store_ejections(keep)
  return active[ep] and intstr(until_ms - now) or 0
end

function OPS.uneject(ARGV)
  -- ARGV 3.. endpoints that (re)turned active in the registry: a replica brought up again at
  -- the address of one that was ejected is not dead. Returns how many ejections were dropped.
  local drop = {}
  for i = 3, #ARGV do drop[ARGV[i]] = true end
  local keep, n = {}, 0
  for _, x in ipairs(ejections()) do
    if drop[x[1]] then n = n + 1 else keep[#keep + 1] = x end
  end
  if n > 0 then store_ejections(keep) end
  return n
end

-- The ops a processor may batch into one call (`batch`).
-- `sync` too: a renewal made before a release must not reach Redis after it (it would lease
-- the released permit again, for nobody, until its TTL).
local BATCHABLE = {acquire = OPS.acquire, admit = OPS.admit, enqueue = OPS.enqueue, cancel = OPS.cancel,
                   release = OPS.release, return_credits = OPS.return_credits, sync = OPS.sync,
                   credit_done = OPS.credit_done, refund = OPS.refund}

function OPS.batch(ARGV)
  -- The admission calls a processor made in one event-loop turn, run in order in one call:
  -- they share the call's cost and its reads (TIME, settings, state, counts, the snapshot's
  -- queue edges), and the hashes are written back once. ARGV 3 the calling gateway, 4 (optional,
  -- a number) the batch's fence, then per op: name, argument count, arguments (as that op takes
  -- them after the TTL). Returns {replies, grants}: each op's reply as a call of its own would
  -- return it ({'err', message} for one that failed: the others still count), and the grants this
  -- call made to the calling gateway's own waiters, as ticket, endpoint pairs (those are not
  -- published: the reply carries them).
  --
  -- The fence: a number that grows with every batch a gateway sends (state.py). A batch whose
  -- caller gave up (a frozen or stalled server) still sits in that server's socket buffer and
  -- runs whenever the server gets to it, possibly after a later batch of the same gateway that
  -- went over another connection: a sync it carries would then lease again permits released
  -- since and queue again waiters that left (phantoms until the next sync). So a batch older
  -- than the newest one this gateway ran is refused whole ('FGSTALE' for each op), while the
  -- gateway is alive; its fence `bx:<gateway>` goes with its liveness (reclaim).
  --
  -- The reply's third element is the fence stored before this batch ('' when none): a processor
  -- that finds it below the fence of a batch whose reply it already had knows that Redis lost
  -- writes it acknowledged (a failover to a replica that had not received them, a restart) and
  -- re-asserts its permits and waiters at once instead of at its next renewal.
  --
  -- The processor also sends that fence (ARGV 5 '@<fence>': the highest of a batch whose reply
  -- it had), so the loss is seen here too, before this batch's ops run: the other gateways'
  -- permits in the lost writes are missing as well, and what they freed is counted free. The
  -- pool then holds its grants (held()) until each gateway alive in this state has synced or
  -- gone unheard; each is told to sync now ('!resync' on its channel). Without it a switchover read 14 in flight
  -- of L 8: the first processor on the new primary granted the permits the other had taken on
  -- the old one since the promotion. A gateway this state knows alive starts that hold; one with
  -- no fence here at all (an emptied Redis, or its liveness purged) starts one that lists the
  -- gateways listening on the pool's channels (below).
  MY_GW, MINE = ARGV[3], {}
  local replies = {}
  local i = 4
  local fence = tonumber(ARGV[4])
  local last
  if fence then
    i = 5
    local acked
    if string.sub(ARGV[5] or '', 1, 1) == '@' then
      acked = tonumber(string.sub(ARGV[5], 2))
      i = 6
    end
    local fx = 'bx:' .. MY_GW
    last = state()[fx]
    if last and fence < last + 0 and gateway_alive(MY_GW) then
      while i <= #ARGV do
        table.insert(replies, {'err', 'FGSTALE a later call of gateway ' .. MY_GW .. ' ran first'})
        i = i + 2 + ARGV[i + 1]
      end
      return {replies, MINE, last}
    end
    if last and acked and last + 0 < acked and gateway_alive(MY_GW) and not held() then start_hold() end
    -- A fence the caller had answered, and none here at all: Redis lost everything this gateway
    -- wrote (emptied: a restart without persistence that no call saw fail, a FLUSHALL, a failover
    -- to a replica that had nothing; or its liveness ran out and was purged). The other gateways'
    -- permits are gone from it too: without a hold this batch's acquires were granted from an
    -- empty pool and the re-assertions came on top (a fault review: 12 in flight of L 6 after a
    -- fast restart). With no liveness left to list, the hold lists the gateways listening on the
    -- pool's channels and tells them to re-assert.
    if not last and acked and not held() then start_hold(false, true) end
    if last and gateway_lapsed(MY_GW) and not held() then start_hold(true) end  -- the clock jumped
    if last ~= ARGV[4] then set_state(fx, ARGV[4]) end
  end
  while i <= #ARGV do
    local op, n = ARGV[i], ARGV[i + 1] + 0
    local sub = {op, ARGV[2], unpack(ARGV, i + 2, i + 1 + n)}  -- sized once (no growth per argument)
    i = i + 2 + n
    local f = BATCHABLE[op]
    if not f then
      table.insert(replies, {'err', 'unknown op ' .. tostring(op)})
    else
      local ok, r = pcall(f, sub)
      if ok then
        table.insert(replies, r)
      else
        table.insert(replies, {'err', type(r) == 'table' and tostring(r.err) or tostring(r)})
        CALL_SNAP = false  -- its whole snapshot, if it built one, is not in the reply: the next one is whole
      end
    end
  end
  return {replies, MINE, last or ''}
end

-- The type each pool key this script writes must have (`active` and `admin_testclock` are
-- not the processors' to write: the controller's registry sync and tests write them).
local KEY_TYPES = {leases = 'zset', lmeta = 'hash', queue = 'zset', qmeta = 'hash', qdl = 'zset',
                   counts = 'hash', state = 'hash', gws = 'zset', epinf = 'hash', lep = 'hash',
                   creditors = 'set', epfill = 'hash', settings = 'hash', qsize = 'hash'}

function OPS.repair(ARGV)
  -- A pool key of the wrong type (a hand, another tool, a key name collision) fails every call
  -- of the pool with WRONGTYPE, and the processors ran on local limits until someone removed
  -- it. Delete the pool keys whose type is wrong, and return their names; the caller's
  -- reconcile then asserts its permits and waiters again into fresh keys (and `configure`
  -- stores the settings again). Runs without the settings (they may be the key that is wrong).
  local gone = {}
  for _, name in ipairs(KEY_NAMES) do
    local want = KEY_TYPES[name]
    if want then
      local t = redis.call('TYPE', K[name])
      t = type(t) == 'table' and t.ok or t
      if t ~= 'none' and t ~= want then
        redis.call('DEL', K[name])
        gone[#gone + 1] = name
      end
    end
  end
  return gone
end

-- Reads: never reclaim, grant or store anything.
local READS = {}

function READS.status(ARGV)
  -- ARGV 3 (optional) gateway for its rank. While the grants are held after lost writes
  -- (held()), `hold` ms left and `hold_gws` the gateways it waits for (read, not written back).
  load_settings()
  local out = snapshot({'granted', '0'}, nil, nil, ARGV[3])
  if held(false) then
    table.insert(out, 'hold') table.insert(out, intstr(HOLD[1] - now))
    table.insert(out, 'hold_gws') table.insert(out, table.concat(HOLD[4], ' '))
  end
  return out
end

function READS.ejections()
  -- The ejected endpoints and the ms each has left: {endpoint, ms, ...}.
  local out = {}
  for _, x in ipairs(ejections()) do
    out[#out + 1] = x[1]
    out[#out + 1] = intstr(x[2] - now)
  end
  return out
end

function READS.get_limit()
  load_settings()
  local s = redis.call('HMGET', K.state, 'limit', 'rtt_noload', 'probe_count', 'probe_jitter', 'version', 'vegas_x')
  return {'limit', s[1] or tostring(limit_value(false)), 'rtt_noload', s[2] or '0', 'probe_count', s[3] or '0',
          'probe_jitter', s[4] or '1', 'version', s[5] or '0', 'extra', s[6] or ''}
end

-- The per-call memos that start empty (a function of its own: a Lua function reaches at most
-- 60 upvalues, and `main` would pass that).
local function reset_memos()
  EDGE, LIVE, NACTIVE, MY_GW, MINE, HAS_LEP = {}, nil, nil, nil, nil, nil
  RT, LVL_DONE, NO_CREDITORS, RAMP, RAMPX, PF = {}, false, false, nil, nil, nil
  LIM, ILIM, QSEQ, RES_L, RRATE, LVL_S, HOLD = nil, nil, nil, nil, {}, nil, nil
  NQ, NQ0, NF, NF0, FQ, FQ_DIRTY = nil, nil, nil, nil, nil, false
end

-- Demand counters (schema.DEMAND), one batch of a processor's at a time, each written once:
-- KEYS after the pool's are the demand hash and the processor's last batch (schema.DEMAND_BATCH,
-- a STRING "nonce:seq"); ARGV 3 the processor's nonce, 4 the batch's seq (growing), then
-- field/count pairs. A batch whose seq is not above the last one of the same nonce is in
-- already (its reply was lost on a frozen server that then ran it, and the processor sent it
-- again: before, counted twice): 0. Else added, 1. Needs no pool settings.
local function add_demand(KEYS, ARGV)
  local n = #KEY_NAMES
  local dkey, bkey, nonce, seq = KEYS[n + 1], KEYS[n + 2], ARGV[3], tonumber(ARGV[4])
  if not (dkey and bkey and seq) then return redis.error_reply('add_demand: keys or seq missing') end
  -- (a key of another type reads as no batch, and SET below replaces it: it cannot stop the counts)
  local last = redis.pcall('GET', bkey)
  if type(last) == 'string' then
    local lnonce, lseq = string.match(last, '^(.*):(%d+)$')
    if lnonce == nonce and tonumber(lseq) >= seq then return 0 end
  end
  for i = 5, #ARGV - 1, 2 do redis.call('HINCRBY', dkey, ARGV[i], ARGV[i + 1]) end
  redis.call('SET', bkey, nonce .. ':' .. ARGV[4], 'PX', 3600000)
  return 1
end

local function main(KEYS, ARGV)
  tonumber, tostring, string, table, math, pcall, unpack, ipairs, pairs, next, type =
    _G.tonumber, _G.tostring, _G.string, _G.table, _G.math, _G.pcall, _G.unpack, _G.ipairs, _G.pairs, _G.next, _G.type
  for i, name in ipairs(KEY_NAMES) do K[name] = KEYS[i] end
  ttl = ARGV[2] + 0
  S, ST, ST_DIRTY, INF, QUE, CNT_DIRTY, ALIVE, LIVE_UNTIL, DUE = nil, nil, nil, nil, nil, false, {}, {}, nil
  REG, CALL_SNAP, HEARS, CALLER = {}, false, {}, nil
  reset_memos()
  -- A clock only tests set (the processors' ACL user may not write keys starting with `a`);
  -- a value that is not a number is none.
  local fake = tonumber(redis.call('GET', K.admin_testclock))
  if fake then
    now = fake
  else
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  NOW_S = intstr(now)
  NOW_EXCL_S = '(' .. NOW_S
  EXPIRY_S = intstr(now + ttl)
  local op = ARGV[1]
  if READS[op] then return READS[op](ARGV) end
  if op == 'add_demand' then return add_demand(KEYS, ARGV) end
  local f = OPS[op]
  if not f then return redis.error_reply('unknown op ' .. tostring(op)) end
  if op == 'repair' then return OPS.repair(ARGV) end
  if op ~= 'configure' and not load_settings() then
    return redis.error_reply('FGNOSETTINGS pool settings missing')
  end
  local out = f(ARGV)
  flush()
  return out
end
