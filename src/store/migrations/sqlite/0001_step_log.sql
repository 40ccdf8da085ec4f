-- agentrun step log, embedded SQLite backend (same semantics as PostgreSQL;
-- SQLite has no roles: the triggers refuse UPDATE and DELETE for everyone).

CREATE TABLE IF NOT EXISTS agentrun_steps (
    run        TEXT    NOT NULL,
    seq        INTEGER NOT NULL CHECK (seq >= 0),
    format     INTEGER NOT NULL,
    kind       TEXT    NOT NULL,
    prev_hash  BLOB    NOT NULL CHECK (length(prev_hash) = 32),
    hash       BLOB    NOT NULL CHECK (length(hash) = 32),
    body       TEXT    NOT NULL,
    epoch      INTEGER NOT NULL,
    created_at INTEGER NOT NULL, -- microseconds since the Unix epoch (UTC)
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS agentrun_leases (
    run         TEXT    PRIMARY KEY,
    holder      TEXT    NOT NULL,
    epoch       INTEGER NOT NULL CHECK (epoch > 0),
    expires_at  INTEGER NOT NULL,
    acquired_at INTEGER NOT NULL,
    renewed_at  INTEGER NOT NULL
);

CREATE TRIGGER IF NOT EXISTS agentrun_steps_no_update
BEFORE UPDATE ON agentrun_steps
BEGIN
    SELECT RAISE(ABORT, 'agentrun_steps is append-only: UPDATE refused');
END;

CREATE TRIGGER IF NOT EXISTS agentrun_steps_no_delete
BEFORE DELETE ON agentrun_steps
BEGIN
    SELECT RAISE(ABORT, 'agentrun_steps is append-only: DELETE refused');
END;
