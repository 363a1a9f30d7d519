"""The Redis store's Lua scripts and key names: each write of a namespace is one atomic script.

The keys (manager/store/redis_store.py's docstring says what each holds) share the hash tag
``{NAMESPACE}``, so every script touches one Cluster slot. Each writing script first checks the
fencing token and the lease (``_LEASE_CHECK``): a manager that lost its lease can never write.
"""

from __future__ import annotations

_LEASE_CHECK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED: another manager took over') end
local h = redis.call('GET', KEYS[2])
if h and h ~= ARGV[2] then return redis.error_reply('FENCED: the lease is held by ' .. h) end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
"""
# KEYS fence lease journal seq; ARGV token owner lease_ms first_seq blob...
COMMIT = _LEASE_CHECK + """
if #ARGV < 5 then return 0 end
local last = tonumber(redis.call('GET', KEYS[4]) or '-1')
local first = tonumber(ARGV[4])
local n = #ARGV - 4
if last >= first + n - 1 then return 0 end
if last ~= first - 1 then return redis.error_reply('SEQ: the journal is at ' .. last .. ', not ' .. (first - 1)) end
redis.call('RPUSH', KEYS[3], unpack(ARGV, 5))
redis.call('SET', KEYS[4], first + n - 1)
return n
"""
# KEYS fence lease snap journal seq; ARGV token owner lease_ms snapshot seq. The journal holds
# batches (last - LLEN + 1 .. last): exactly those up to the snapshot's seq are trimmed, however
# many the loop appended meanwhile; a journal that has not reached seq yet is refused (BEHIND).
SNAPSHOT = _LEASE_CHECK + """
local want = tonumber(ARGV[5])
local last = tonumber(redis.call('GET', KEYS[5]) or ARGV[5])
if last < want then return redis.error_reply('BEHIND: the journal is at ' .. last) end
local drop = want - (last - redis.call('LLEN', KEYS[4]))
if drop > 0 then redis.call('LTRIM', KEYS[4], drop, -1) end
redis.call('SET', KEYS[3], ARGV[4])
redis.call('SET', KEYS[5], last)
return 1
"""
# KEYS lease fence; ARGV owner lease_ms -> the new fencing token, or nil while another holds it
ACQUIRE = """
local h = redis.call('GET', KEYS[1])
if h and h ~= ARGV[1] then return false end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""
READ = ("return {redis.call('GET', KEYS[1]) or '', redis.call('LRANGE', KEYS[2], 0, -1), "
        "redis.call('GET', KEYS[3]) or '', redis.call('GET', KEYS[4]) or ''}")
# KEYS lease clean; ARGV owner seq: a clean stop says that nothing past ``seq`` was acknowledged
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return redis.call('DEL', KEYS[1])
"""


def namespace_keys(namespace: str) -> dict[str, str]:
    return {k: f"kvpool:{{{namespace}}}:{k}" for k in ("snap", "journal", "seq", "lease", "fence", "clean")}
