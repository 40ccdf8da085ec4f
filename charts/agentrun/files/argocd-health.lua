-- Argo CD health check for agentrun.dev/AgentRun (see docs/install.md, "GitOps with Argo CD").
-- Install it in argocd-cm as resource.customizations.health.agentrun.dev_AgentRun.
--   Pending, Running                                   -> Progressing
--   AwaitingApproval                                   -> Suspended (a person must decide)
--   Succeeded                                          -> Healthy
--   Failed, Cancelled, BudgetExceeded, DeadlineExceeded -> Degraded
local hs = {}
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the agentrun controller"
  return hs
end
local phase = status.phase
local final = phase == "Succeeded" or phase == "Failed" or phase == "Cancelled"
  or phase == "BudgetExceeded" or phase == "DeadlineExceeded"
-- A live run whose spec changed (e.g. spec.cancel) and the controller has not acted yet.
if not final and obj.metadata ~= nil and obj.metadata.generation ~= nil
    and status.observedGeneration ~= nil and status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = phase .. ", waiting for the controller to observe generation " .. obj.metadata.generation
  return hs
end
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = status.result or "Succeeded"
elseif phase == "AwaitingApproval" then
  hs.status = "Suspended"
  local name = "an Approval"
  if status.approval ~= nil and status.approval.name ~= nil then
    name = "approval " .. status.approval.name
  end
  hs.message = "Waiting for " .. name .. " (kubectl agentrun approve|reject|edit)"
  if status.approval ~= nil and status.approval.expiresAt ~= nil then
    hs.message = hs.message .. ", expires " .. status.approval.expiresAt
  end
elseif final then
  hs.status = "Degraded"
  hs.message = phase
  if status.error ~= nil then
    hs.message = phase .. ": " .. status.error
  end
else
  hs.status = "Progressing"
  hs.message = phase
  if status.waitingOn ~= nil then
    hs.message = phase .. ", waiting on " .. status.waitingOn
  end
end
return hs
