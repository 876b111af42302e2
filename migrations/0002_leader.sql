-- Who leads (high availability, issue 6). The lock itself is outside this table (a PostgreSQL
-- advisory lock held by the leader's session; a file lock beside a SQLite database): this row
-- only tells standbys, the CLI and agents where the leader is. `term` grows by one on every
-- change of leader. Never edit this file once landed; add a new migration.

CREATE TABLE leader (
    id        BIGINT PRIMARY KEY,   -- always 1: one row
    term      BIGINT NOT NULL,
    rest_url  TEXT NOT NULL,
    grpc_url  TEXT NOT NULL,
    since_ms  BIGINT NOT NULL
);
INSERT INTO leader (id, term, rest_url, grpc_url, since_ms) VALUES (1, 0, '', '', 0);
