-- Motley's durable state (docs/state.md says what is durable and what is rebuilt from
-- heartbeats). Portable SQL: the same file runs on SQLite and PostgreSQL. Identifiers come
-- from the counters table (UPDATE ... RETURNING), not from SERIAL/AUTOINCREMENT, which differ.
-- Never edit this file once landed; add a new migration.

CREATE TABLE counters (
    name  TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
INSERT INTO counters (name, value) VALUES ('job_id', 0);
INSERT INTO counters (name, value) VALUES ('event_seq', 0);

-- The inventory: one row per node that ever registered.
CREATE TABLE nodes (
    name             TEXT PRIMARY KEY,
    inventory        TEXT NOT NULL,   -- the node's cluster-file entry, JSON
    state            TEXT NOT NULL,   -- active | draining
    agent_epoch      BIGINT NOT NULL, -- +1 on every registration: fences an agent's older sessions
    registered_at_ms BIGINT NOT NULL
);

CREATE TABLE jobs (
    id            BIGINT PRIMARY KEY,
    name          TEXT NOT NULL,
    spec          TEXT NOT NULL,      -- the job file, JSON
    state         TEXT NOT NULL,      -- submitted | planning | launching | running | succeeded | failed | cancelled
    generation    BIGINT NOT NULL,    -- 0 until the first launch; +1 on every (re)launch
    reason        TEXT,               -- why it failed or was cancelled
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

-- One plan per launch of a job.
CREATE TABLE plans (
    job_id        BIGINT NOT NULL REFERENCES jobs (id),
    generation    BIGINT NOT NULL,
    plan          TEXT NOT NULL,      -- `motley plan -o json`
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, generation)
);

-- Which GPU runs which rank of a launch, with the seams for checkpoints and recovery.
CREATE TABLE ranks (
    job_id      BIGINT NOT NULL,
    generation  BIGINT NOT NULL,
    rank        BIGINT NOT NULL,
    node        TEXT NOT NULL REFERENCES nodes (name),
    local_rank  BIGINT NOT NULL,
    gpu         BIGINT NOT NULL,
    replica     BIGINT NOT NULL,
    stage       BIGINT NOT NULL,
    layer_start BIGINT NOT NULL,
    layer_end   BIGINT NOT NULL,
    state       TEXT NOT NULL,        -- assigned | running | exited | lost
    exit_code   BIGINT,
    PRIMARY KEY (job_id, generation, rank),
    FOREIGN KEY (job_id, generation) REFERENCES plans (job_id, generation)
);
CREATE INDEX ranks_by_node ON ranks (node, state);

-- What happened, in order: `motley job watch` replays them.
CREATE TABLE events (
    seq        BIGINT PRIMARY KEY,
    job_id     BIGINT,
    generation BIGINT,
    kind       TEXT NOT NULL,
    message    TEXT NOT NULL,
    at_ms      BIGINT NOT NULL
);
CREATE INDEX events_by_job ON events (job_id, seq);
