-- Scale (issue 12): a released lease is told apart from a lapsed one, and
-- lapsed leases are found with one indexed query. Never edit an applied migration.
ALTER TABLE agentrun_leases ADD COLUMN released INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS agentrun_leases_lapsing ON agentrun_leases (expires_at) WHERE released = 0;
