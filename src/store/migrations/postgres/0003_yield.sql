-- FollowLatest at step boundaries (issue 12): the controller asks the worker
-- holding a run's lease to yield; the worker reads it when it renews and stops
-- before its next model call. A new holder starts without the request.
ALTER TABLE agentrun_leases ADD COLUMN IF NOT EXISTS yield_requested boolean NOT NULL DEFAULT false;
