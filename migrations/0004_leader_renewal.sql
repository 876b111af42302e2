-- The leader's proof of life (issue 13): a PostgreSQL leader writes the database's own clock
-- here every base interval. A standby that finds it older than its stale limit ends the lock
-- session of a leader that stopped renewing (a frozen process keeps its session, and so the
-- advisory lock, alive) and takes over. 0: never renewed (not read). Never edit once landed.

ALTER TABLE leader ADD COLUMN renewed_at_ms BIGINT NOT NULL DEFAULT 0;
