-- agentrun step log, PostgreSQL (DESIGN.md section 3).
-- Applied by `agentrun store migrate` (sqlx migrator, advisory-locked, recorded
-- in agentrun_store_migrations). Never edit an applied migration: add a new one.

-- Roles (cluster-wide, NOLOGIN groups; grant membership to login users).
--   agentrun_writer:    INSERT + SELECT on steps, SELECT/INSERT/UPDATE on leases
--   agentrun_retention: the only role the append-only trigger lets remove steps
-- Another database's migration may create them at the same moment: tolerate it.
DO $$
BEGIN
    BEGIN
        CREATE ROLE agentrun_writer NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
    BEGIN
        CREATE ROLE agentrun_retention NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
END
$$;

CREATE TABLE IF NOT EXISTS agentrun_steps (
    run        text        NOT NULL,
    seq        bigint      NOT NULL CHECK (seq >= 0),
    format     integer     NOT NULL,
    kind       text        NOT NULL,
    prev_hash  bytea       NOT NULL CHECK (octet_length(prev_hash) = 32),
    hash       bytea       NOT NULL CHECK (octet_length(hash) = 32),
    -- The canonical record (RFC 8785 JSON without hash and createdAt): the hashed bytes.
    body       text        NOT NULL,
    -- Lease epoch of the writer (metadata, not hashed).
    epoch      bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, seq)
);

-- Leases are not the log: they are updated in place.
CREATE TABLE IF NOT EXISTS agentrun_leases (
    run         text        PRIMARY KEY,
    holder      text        NOT NULL,
    epoch       bigint      NOT NULL CHECK (epoch > 0),
    expires_at  timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL
);

-- Append-only: UPDATE, DELETE and TRUNCATE are refused for every role that is
-- not (a member of) agentrun_retention. Superusers are not exempt: membership
-- is looked up in pg_auth_members (pg_has_role would let a superuser through).
CREATE OR REPLACE FUNCTION agentrun_steps_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        WITH RECURSIVE r(oid) AS (
            SELECT oid FROM pg_roles WHERE rolname = current_user
            UNION
            SELECT m.roleid FROM pg_auth_members m JOIN r ON m.member = r.oid
        )
        SELECT 1 FROM r JOIN pg_roles p ON p.oid = r.oid
        WHERE p.rolname = 'agentrun_retention'
    ) THEN
        IF TG_LEVEL = 'STATEMENT' THEN
            RETURN NULL;
        ELSIF TG_OP = 'DELETE' THEN
            RETURN OLD;
        ELSE
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'agentrun_steps is append-only: % refused for role %', TG_OP, current_user
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'only members of agentrun_retention may remove steps';
END
$$;

DROP TRIGGER IF EXISTS agentrun_steps_append_only ON agentrun_steps;
CREATE TRIGGER agentrun_steps_append_only
    BEFORE UPDATE OR DELETE ON agentrun_steps
    FOR EACH ROW EXECUTE FUNCTION agentrun_steps_append_only();

DROP TRIGGER IF EXISTS agentrun_steps_no_truncate ON agentrun_steps;
CREATE TRIGGER agentrun_steps_no_truncate
    BEFORE TRUNCATE ON agentrun_steps
    FOR EACH STATEMENT EXECUTE FUNCTION agentrun_steps_append_only();

REVOKE ALL ON agentrun_steps, agentrun_leases FROM PUBLIC;
GRANT SELECT, INSERT ON agentrun_steps TO agentrun_writer;
GRANT SELECT, INSERT, UPDATE ON agentrun_leases TO agentrun_writer;
GRANT SELECT, DELETE ON agentrun_steps TO agentrun_retention;
GRANT SELECT, DELETE ON agentrun_leases TO agentrun_retention;

DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO agentrun_writer, agentrun_retention', current_schema());
END
$$;
