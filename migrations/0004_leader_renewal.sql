-- The leader's proof of life (issue 13): a PostgreSQL leader writes the database's own clock
-- here every base interval. A standby that finds it older than its stale limit ends the lock
-- session of a leader that stopped renewing (a frozen process keeps its session, and so the
-- advisory lock, alive) and takes over. A row apart from `leader`, whose row every job move
-- locks (the term fence): a renewal never waits behind a move. 0: never renewed (not read).
-- Never edit once landed.

CREATE TABLE leader_renewal (
    id             BIGINT PRIMARY KEY,   -- always 1: one row
    renewed_at_ms  BIGINT NOT NULL
);
INSERT INTO leader_renewal (id, renewed_at_ms) VALUES (1, 0);
