-- wrk's script for benchmarks/serve_load.py: each request POSTs the next of a file of ready JSON bodies
-- (one per line, each connection's thread starting at a random one), every answer's status is counted,
-- and at the end one line "GPUFORGE {json}" gives the requests, the window, errors, the statuses and the
-- latency percentiles (microseconds) for the caller to read.
--     wrk -t1 -c32 -d10s -s benchmarks/serve_wrk.lua http://127.0.0.1:8700/predict -- bodies.jsonl

local bodies, k = {}, 0
local threads = {}
statuses = {}  -- global: done() reads each thread's through thread:get

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  for line in io.lines(args[1]) do
    if #line > 0 then table.insert(bodies, line) end
  end
  k = math.random(#bodies)
end

local headers = {["Content-Type"] = "application/json"}

function request()
  k = k % #bodies + 1
  return wrk.format("POST", nil, headers, bodies[k])
end

function response(status, _, _)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, _)
  local counts = {}
  for _, thread in ipairs(threads) do
    for code, n in pairs(thread:get("statuses")) do counts[code] = (counts[code] or 0) + n end
  end
  local parts = {}
  for code, n in pairs(counts) do table.insert(parts, string.format('"%d": %d', code, n)) end
  local e = summary.errors
  io.write(string.format(
    'GPUFORGE {"requests": %d, "duration_us": %d, "errors": {"connect": %d, "read": %d, "write": %d, ' ..
    '"timeout": %d}, "statuses": {%s}, "latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d}}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, table.concat(parts, ", "),
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
