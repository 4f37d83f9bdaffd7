-- Argo CD health check of rlrun.dev/RLRun (docs/gitops.md; tests/unit/test_argocd_health.py runs it).
-- Reads what the operator writes (operator/rlrun_operator/status.py): status.phase, status.observedGeneration
-- (the generation applied to the children), status.replicas.<role> {desired, ready, updated} and the
-- conditions Ready and Degraded, each with the generation it was computed from. Uses only Lua 5.1's base
-- and table libraries (Argo CD opens no string or math library unless useOpenLibs is set).
local hs = {status = "Progressing", message = "waiting for the operator to report the run's status"}
local generation = 0
if obj.metadata ~= nil and obj.metadata.generation ~= nil then
  generation = obj.metadata.generation
end
local st = obj.status
if st == nil or st.conditions == nil then
  return hs
end

local ready, degraded
for _, c in ipairs(st.conditions) do
  if c.type == "Ready" then
    ready = c
  elseif c.type == "Degraded" then
    degraded = c
  end
end
local function describe(c)
  local text = c.reason or c.type
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end
if ready == nil then
  return hs
end

-- A status computed before the current spec says nothing about it.
if (ready.observedGeneration or 0) < generation then
  hs.message = "the operator has not evaluated generation " .. tostring(generation) .. " yet"
  return hs
end
if ready.reason == "InvalidSpec" then
  hs.status = "Degraded"
  hs.message = describe(ready)
  return hs
end
if st.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = describe(degraded or ready)
  return hs
end
if st.phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = "the run succeeded"
  if st.step ~= nil then
    hs.message = hs.message .. " at step " .. tostring(st.step)
  end
  return hs
end
if st.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = describe(ready)
  return hs
end
if (st.observedGeneration or 0) < generation then
  hs.message = "generation " .. tostring(generation) .. " is not applied to the children yet"
  return hs
end
if degraded ~= nil and degraded.status == "True" and degraded.reason ~= "ReplicasUnavailable" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end

-- Roles still rolling out (updated < desired) are progress, not damage.
local rolling = {}
for _, role in ipairs({"trainer", "inference", "prefill", "decode", "router", "orchestrator"}) do
  local r = st.replicas and st.replicas[role]
  if r ~= nil and (r.updated or 0) < (r.desired or 0) then
    table.insert(rolling, role .. " " .. tostring(r.updated or 0) .. "/" .. tostring(r.desired) .. " updated")
  end
end
if #rolling > 0 then
  hs.message = "rolling out: " .. table.concat(rolling, ", ")
  return hs
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
hs.message = describe(ready)
return hs
