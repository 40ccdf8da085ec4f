-- Scale (issue 12): a released lease is told apart from a lapsed one, lapsed
-- leases are found with one indexed query, and every change of a run's head
-- (an appended record, a released lease) is announced on the channel
-- `agentrun_heads` with the run's uid, so the controller reacts to events
-- instead of polling each run. Never edit an applied migration.

ALTER TABLE agentrun_leases ADD COLUMN IF NOT EXISTS released boolean NOT NULL DEFAULT false;

CREATE INDEX IF NOT EXISTS agentrun_leases_lapsing
    ON agentrun_leases (expires_at) WHERE NOT released;

CREATE OR REPLACE FUNCTION agentrun_announce_head() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('agentrun_heads', NEW.run);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS agentrun_steps_announce ON agentrun_steps;
CREATE TRIGGER agentrun_steps_announce
    AFTER INSERT ON agentrun_steps
    FOR EACH ROW EXECUTE FUNCTION agentrun_announce_head();

DROP TRIGGER IF EXISTS agentrun_leases_announce ON agentrun_leases;
CREATE TRIGGER agentrun_leases_announce
    AFTER UPDATE OF released ON agentrun_leases
    FOR EACH ROW WHEN (NEW.released AND NOT OLD.released)
    EXECUTE FUNCTION agentrun_announce_head();
