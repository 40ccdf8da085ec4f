-- FollowLatest at step boundaries (issue 12): see the PostgreSQL migration.
ALTER TABLE agentrun_leases ADD COLUMN yield_requested INTEGER NOT NULL DEFAULT 0;
